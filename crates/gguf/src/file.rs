//! GGUF container parsing: header, metadata key/values, tensor infos, memory-mapped data.
//!
//! Format reference: ggml's `docs/gguf.md` (versions 2 and 3, little-endian). Every read is
//! bounds-checked against the file length so that a truncated or hostile file yields a
//! [`GgufError`] rather than a panic; counts read from the file are sanity-limited before
//! anything is allocated from them.

use std::collections::BTreeMap;
use std::path::Path;

use memmap2::Mmap;

use crate::error::{GgufError, Result};
use crate::types::GgmlType;

/// A metadata value as stored in the file.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F32(_) => "f32",
            MetaValue::F64(_) => "f64",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }

    /// Any integer type as u64 (negative values are rejected).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) if v >= 0 => Some(v as u64),
            MetaValue::I16(v) if v >= 0 => Some(v as u64),
            MetaValue::I32(v) if v >= 0 => Some(v as u64),
            MetaValue::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where a tensor lives in the file and what it holds.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGML order: `dims[0]` is the contiguous (row) length.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset_bytes: u64,
    pub size_bytes: u64,
}

impl TensorInfo {
    pub fn n_elems(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Elements per row (the contiguous dimension).
    pub fn row_len(&self) -> usize {
        self.dims.first().copied().unwrap_or(1) as usize
    }
    /// Number of rows (product of all other dimensions).
    pub fn n_rows(&self) -> usize {
        self.dims.iter().skip(1).product::<u64>() as usize
    }
}

/// An opened GGUF file: parsed metadata and tensor infos over a memory map of the data.
pub struct GgufFile {
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    tensor_index: BTreeMap<String, usize>,
    mmap: Mmap,
}

// Sanity limits on counts read from the file, so a corrupted header cannot make us allocate
// gigabytes before the bounds checks notice. They are far above any real model's needs.
const MAX_TENSORS: u64 = 1 << 20;
const MAX_METADATA_KV: u64 = 1 << 20;
const MAX_DIMS: u32 = 4;
const MAX_STRING_BYTES: u64 = 1 << 30;

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8]> {
        let end = (self.pos as u64)
            .checked_add(n)
            .filter(|&e| e <= self.buf.len() as u64);
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end as usize];
                self.pos = end as usize;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                offset: self.pos as u64,
                needed: n,
                file_len_bytes: self.buf.len() as u64,
            }),
        }
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self
            .take(N as u64)?
            .try_into()
            .expect("take returned N bytes"))
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        if len > MAX_STRING_BYTES {
            return Err(GgufError::Invalid(format!(
                "string length {len} is implausible"
            )));
        }
        let bytes = self.take(len)?;
        // Vocabularies may contain invalid UTF-8 in principle; keep the bytes losslessly
        // readable rather than failing the whole load.
        Ok(String::from_utf8_lossy(bytes).into_owned())
    }

    fn value(&mut self, type_id: u32, depth: u32) -> Result<MetaValue> {
        Ok(match type_id {
            0 => MetaValue::U8(self.u8()?),
            1 => MetaValue::I8(self.u8()? as i8),
            2 => MetaValue::U16(self.u16()?),
            3 => MetaValue::I16(self.u16()? as i16),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(self.u32()? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32()?)),
            7 => MetaValue::Bool(self.u8()? != 0),
            8 => MetaValue::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(GgufError::Invalid(
                        "metadata arrays nested too deeply".into(),
                    ));
                }
                let elem_type = self.u32()?;
                let n = self.u64()?;
                // Each element takes at least one byte, so a count beyond the remaining
                // bytes is certainly corrupt; checking first bounds the allocation.
                if n > (self.buf.len() - self.pos) as u64 {
                    return Err(GgufError::Truncated {
                        offset: self.pos as u64,
                        needed: n,
                        file_len_bytes: self.buf.len() as u64,
                    });
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem_type, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(self.u64()? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64()?)),
            t => {
                return Err(GgufError::Invalid(format!(
                    "unknown metadata value type {t}"
                )))
            }
        })
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file, memory-mapping its tensor data.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let io_err = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io_err)?;
        // A directory opens, and then fails to map with "No such device".
        if file.metadata().map_err(io_err)?.is_dir() {
            return Err(GgufError::Invalid(format!(
                "{} is a directory, not a GGUF file",
                path.display()
            )));
        }
        // SAFETY: the map is read-only; the file is not expected to change while we run. A
        // concurrent truncation would be a user error we cannot defend against with mmap.
        #[allow(unsafe_code)]
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_err)?;
        Self::parse(mmap)
    }

    fn parse(mmap: Mmap) -> Result<GgufFile> {
        let mut r = Reader { buf: &mmap, pos: 0 };
        let magic: [u8; 4] = r.array()?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { version });
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        if n_tensors > MAX_TENSORS || n_kv > MAX_METADATA_KV {
            return Err(GgufError::Invalid(format!(
                "implausible counts: {n_tensors} tensors, {n_kv} metadata entries"
            )));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let type_id = r.u32()?;
            let value = r.value(type_id, 0)?;
            if metadata.contains_key(&key) {
                return Err(GgufError::Duplicate {
                    what: "metadata key",
                    name: key,
                });
            }
            metadata.insert(key, value);
        }
        let alignment = match metadata.get("general.alignment") {
            Some(v) => v.as_u64().filter(|a| a.is_power_of_two()).ok_or_else(|| {
                GgufError::Invalid("general.alignment must be a power of two".into())
            })?,
            None => 32,
        };
        let raw = (0..n_tensors)
            .map(|_| RawTensor::read(&mut r))
            .collect::<Result<Vec<_>>>()?;
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
        let file_len_bytes = mmap.len() as u64;
        let mut tensors = Vec::with_capacity(raw.len());
        let mut tensor_index = BTreeMap::new();
        for t in raw {
            let info = t.checked(data_start, file_len_bytes)?;
            if tensor_index.contains_key(&info.name) {
                return Err(GgufError::Duplicate {
                    what: "tensor",
                    name: info.name,
                });
            }
            tensor_index.insert(info.name.clone(), tensors.len());
            tensors.push(info);
        }
        Ok(GgufFile {
            version,
            metadata,
            tensors,
            tensor_index,
            mmap,
        })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        v.as_u64().ok_or_else(|| GgufError::WrongType {
            key: key.into(),
            found: v.type_name(),
            expected: "integer",
        })
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        v.as_f64().ok_or_else(|| GgufError::WrongType {
            key: key.into(),
            found: v.type_name(),
            expected: "number",
        })
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        v.as_str().ok_or_else(|| GgufError::WrongType {
            key: key.into(),
            found: v.type_name(),
            expected: "string",
        })
    }

    /// A string array (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))?;
        let wrong = || GgufError::WrongType {
            key: key.into(),
            found: v.type_name(),
            expected: "string array",
        };
        v.as_array()
            .ok_or_else(wrong)?
            .iter()
            .map(|e| e.as_str().ok_or_else(wrong))
            .collect()
    }

    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))
    }

    /// The raw bytes of a tensor, borrowed from the memory map.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        // Bounds were checked against the file length when the infos were parsed.
        &self.mmap[info.offset_bytes as usize..(info.offset_bytes + info.size_bytes) as usize]
    }

    /// Drops this process's resident pages of a tensor's bytes (the pages it shares with
    /// its neighbours too): a loader that has converted a tensor into its own memory calls
    /// it so that the mapped file and the converted copy are not both resident. Reading the
    /// tensor again later stays correct: the pages fault back in from the file.
    #[cfg(unix)]
    pub fn release_tensor_pages(&self, info: &TensorInfo) {
        const PAGE: usize = 4096;
        let start = info.offset_bytes as usize / PAGE * PAGE;
        let end = ((info.offset_bytes + info.size_bytes) as usize)
            .next_multiple_of(PAGE)
            .min(self.mmap.len());
        // SAFETY: the map is a read-only shared mapping of a file that we never write, so
        // MADV_DONTNEED only drops page-table entries: no borrowed byte changes, and the
        // next read of the range faults the same bytes back in from the page cache. The
        // range lies inside the map (clamped above). The advice is a hint; errors are moot.
        #[allow(unsafe_code)]
        let _ = unsafe {
            self.mmap.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                start,
                end.saturating_sub(start),
            )
        };
    }

    #[cfg(not(unix))]
    pub fn release_tensor_pages(&self, _info: &TensorInfo) {}

    pub fn file_len_bytes(&self) -> u64 {
        self.mmap.len() as u64
    }
}

/// A tensor's header entry as read, before its type, size and offset are checked.
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    rel_offset: u64,
}

impl RawTensor {
    fn read(r: &mut Reader) -> Result<RawTensor> {
        let name = r.string()?;
        let n_dims = r.u32()?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::Invalid(format!(
                "tensor {name} has {n_dims} dimensions"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(r.u64()?);
        }
        let type_id = r.u32()?;
        let rel_offset = r.u64()?;
        Ok(RawTensor {
            name,
            dims,
            type_id,
            rel_offset,
        })
    }

    /// The tensor with its type known, its rows whole blocks and its bytes inside the file.
    fn checked(self, data_start: u64, file_len_bytes: u64) -> Result<TensorInfo> {
        let RawTensor {
            name,
            dims,
            type_id,
            rel_offset,
        } = self;
        let ggml_type =
            GgmlType::from_id(type_id).map_err(|type_name| GgufError::UnsupportedType {
                type_id,
                name: type_name,
                tensor: name.clone(),
            })?;
        let n_elems = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| GgufError::Invalid(format!("tensor {name}: element count overflows")))?;
        if dims[0] % ggml_type.block_elems() as u64 != 0 {
            return Err(GgufError::Invalid(format!(
                "tensor {name}: row length {} is not a multiple of the {} block size {}",
                dims[0],
                ggml_type,
                ggml_type.block_elems()
            )));
        }
        let size_bytes = n_elems / ggml_type.block_elems() as u64 * ggml_type.block_bytes() as u64;
        let offset_bytes = data_start
            .checked_add(rel_offset)
            .ok_or_else(|| GgufError::Invalid(format!("tensor {name}: offset overflows")))?;
        if offset_bytes
            .checked_add(size_bytes)
            .is_none_or(|end| end > file_len_bytes)
        {
            return Err(GgufError::Truncated {
                offset: offset_bytes,
                needed: size_bytes,
                file_len_bytes,
            });
        }
        Ok(TensorInfo {
            name,
            dims,
            ggml_type,
            offset_bytes,
            size_bytes,
        })
    }
}
