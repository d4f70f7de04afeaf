//! Pure KV-cache core (placeholder until the pool lands).
