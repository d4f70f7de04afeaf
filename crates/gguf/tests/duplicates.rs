//! A metadata key or tensor name given twice is refused by name, as llama.cpp's reader
//! (`gguf_init_from_file_impl`) refuses it, instead of the last copy silently winning.

use pk_gguf::{GgufError, GgufFile};

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A GGUF v3 file with u32 metadata `kvs` and one-dimensional f32 tensors of four
/// elements named `tensors`, each at its own 32-byte-aligned offset.
fn gguf_bytes(kvs: &[(&str, u32)], tensors: &[&str]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((kvs.len() as u64).to_le_bytes());
    for (key, value) in kvs {
        put_str(&mut out, key);
        out.extend(4u32.to_le_bytes());
        out.extend(value.to_le_bytes());
    }
    let tensor_stride_bytes = 32u64;
    for (i, name) in tensors.iter().enumerate() {
        put_str(&mut out, name);
        out.extend(1u32.to_le_bytes()); // dimensions
        out.extend(4u64.to_le_bytes()); // elements
        out.extend(0u32.to_le_bytes()); // GGML_TYPE_F32
        out.extend((i as u64 * tensor_stride_bytes).to_le_bytes());
    }
    out.resize(out.len().div_ceil(32) * 32, 0);
    out.resize(out.len() + tensors.len() * tensor_stride_bytes as usize, 0);
    out
}

fn open(name: &str, bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    let path = std::env::temp_dir().join(format!("pk-gguf-{}-{name}.gguf", std::process::id()));
    std::fs::write(&path, bytes).expect("temp dir is writable");
    let f = GgufFile::open(&path);
    let _ = std::fs::remove_file(&path);
    f
}

#[test]
fn distinct_keys_and_tensors_load() {
    let f = open(
        "distinct",
        gguf_bytes(&[("a.x", 1), ("a.y", 2)], &["t0", "t1"]),
    )
    .unwrap();
    assert_eq!(
        (f.get_u64("a.x").unwrap(), f.get_u64("a.y").unwrap()),
        (1, 2)
    );
    assert_eq!(f.tensors.len(), 2);
}

#[test]
fn a_duplicate_metadata_key_is_refused_by_name() {
    let Err(err) = open("dupkey", gguf_bytes(&[("a.x", 1), ("a.x", 2)], &[])) else {
        panic!("a duplicate key loaded");
    };
    assert!(
        matches!(&err, GgufError::Duplicate { what: "metadata key", name } if name == "a.x"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "invalid GGUF: duplicate metadata key \"a.x\""
    );
}

#[test]
fn a_duplicate_tensor_name_is_refused_by_name() {
    let Err(err) = open(
        "duptensor",
        gguf_bytes(&[("a.x", 1)], &["t0", "blk.0.w", "blk.0.w"]),
    ) else {
        panic!("a duplicate tensor loaded");
    };
    assert!(
        matches!(&err, GgufError::Duplicate { what: "tensor", name } if name == "blk.0.w"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "invalid GGUF: duplicate tensor \"blk.0.w\""
    );
}
