//! Stop strings over streamed text.
//!
//! Text is released to the caller only once no stop string can still begin inside it, so
//! a client never sees the first half of a stop string that later completes. On a match
//! the text is cut just before the stop string (OpenAI semantics: the stop is not returned).

pub struct StopMatcher {
    stops: Vec<String>,
    /// Everything accepted so far (emitted or held back).
    text: String,
    /// Bytes of `text` already handed to the caller.
    emitted: usize,
    stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> StopMatcher {
        let stops = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        StopMatcher {
            stops,
            text: String::new(),
            emitted: 0,
            stopped: false,
        }
    }

    /// Adds a piece; returns the text that is now safe to emit and whether a stop matched.
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        let search_from = self.emitted;
        self.text.push_str(piece);
        // The earliest match wins; a stop may begin inside text held back earlier.
        let hit = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|i| search_from + i)
            })
            .min();
        if let Some(at) = hit {
            self.text.truncate(at);
            self.stopped = true;
            return (self.release(at), true);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if self.text.ends_with(&s[..k]) {
                    hold = hold.max(k);
                }
            }
        }
        let safe = self.text.len() - hold;
        (self.release(safe), false)
    }

    fn release(&mut self, upto: usize) -> String {
        let upto = upto.max(self.emitted);
        let out = self.text[self.emitted..upto].to_string();
        self.emitted = upto;
        out
    }

    /// Flushes what was held back (generation ended for another reason).
    pub fn finish(&mut self, tail: &str) -> String {
        if !self.stopped {
            let (mut out, hit) = self.push(tail);
            if !hit {
                let len = self.text.len();
                out.push_str(&self.release(len));
            }
            return out;
        }
        String::new()
    }

    /// All text produced, cut before a matched stop string.
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = vec![];
        let mut hit = false;
        for p in pieces {
            let (e, h) = m.push(p);
            out.push(e);
            if h {
                hit = true;
                break;
            }
        }
        if !hit {
            out.push(m.finish(""));
        }
        (out, m.text().to_string(), hit)
    }

    #[test]
    fn stop_split_across_pieces_is_never_emitted() {
        let (out, text, hit) = run(&["END"], &["hello E", "N", "D more"]);
        assert_eq!(out, vec!["hello ", "", ""]);
        assert_eq!(text, "hello ");
        assert!(hit);
    }

    #[test]
    fn held_back_prefix_is_released_when_it_diverges() {
        let (out, text, hit) = run(&["END"], &["a E", "x"]);
        assert_eq!(out, vec!["a ", "Ex", ""]);
        assert_eq!(text, "a Ex");
        assert!(!hit);
    }

    #[test]
    fn no_stops_streams_everything() {
        let (out, _, _) = run(&[], &["a", "b"]);
        assert_eq!(out, vec!["a", "b", ""]);
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let (_, text, hit) = run(&["yz", "x"], &["abxyz"]);
        assert_eq!(text, "ab");
        assert!(hit);
    }
}
