//! Checkpoints: every variable a trainer holds (parameters, optimizer state, the iteration
//! counter) in one safetensors file, the format PyTorch, JAX (flax), Keras 3 and Hugging Face
//! read and write: tensors by name, f32, little-endian, row-major, and a JSON header. F16 and
//! BF16 tensors (how Hugging Face and mixed-precision runs often store weights) are read into
//! f32 variables, widened exactly (every half value is an f32 value), and `save_as` writes a
//! half copy of f32 variables, each value rounded to the nearest half (ties to even).
//!
//! Why safetensors: it is a plain, checked container (no code runs on load, unlike a pickle),
//! other tools open it, and a kiln variable's key ("dense/kernel", "optimizer/dense/kernel/m")
//! is its tensor name, so a checkpoint is readable as is. Loading compares the file with the
//! variables the trainer's plans declare and names every difference (missing, unexpected,
//! another shape or dtype) in one error, before anything is written: a half-loaded model
//! would train on silently.
//!
//! Why `read` checks the header itself instead of handing it to the safetensors crate: a file
//! from outside may be truncated, damaged or hostile, and the crate's messages ("incomplete
//! metadata, file not fully covered", "invalid shape, data type, or offset") name neither the
//! tensor nor the rule, and its JSON parser keeps the last of two entries of one name. `read`
//! parses the header with a small JSON reader of its own that sees duplicates and reports byte
//! offsets, then checks every rule of the format before it reads one tensor byte:
//!
//! - the header length (the first 8 bytes, u64 little-endian) is at most [`MAX_HEADER_BYTES`]
//!   (safetensors' own limit) and fits in the file;
//! - the header is UTF-8 JSON: one object mapping each tensor's name (unique) to an object with
//!   `dtype` (a safetensors dtype name), `shape` and `data_offsets` (non-negative integers, two
//!   offsets), and an optional `__metadata__` object mapping strings to strings;
//! - each tensor's offsets are in order (begin <= end) and span exactly its shape's elements times
//!   its dtype's size, computed without overflow;
//! - the tensors tile the data region: no gap, no overlap, nothing after the last, and nothing
//!   missing (a truncated file names the tensor whose bytes run past the end, and how many).
//!
//! Every buffer whose size the file gives (the header, each tensor's data) is reserved with
//! `try_reserve`, so that a lying length is an error, never an abort.

use crate::error::{Result, RuntimeError};
use crate::tensor::HostTensor;
use kiln_compiler::ir::{DType, Shape};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// The header's metadata, so that a file says what wrote it.
const FORMAT: (&str, &str) = ("format", "kiln checkpoint 1");

/// The longest header `read` accepts, in bytes: safetensors' own limit (`MAX_HEADER_SIZE`). A
/// longer length in a file's first 8 bytes is damage, not a checkpoint.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// How deep `read` follows nested JSON arrays and objects in a header field it skips.
const MAX_DEPTH: usize = 64;

/// Writes `variables` (name, value) to `path` as safetensors.
pub fn save(path: &Path, variables: &[(String, HostTensor)]) -> Result<()> {
    // The views borrow the tensors' bytes (kiln's targets are little-endian, as safetensors
    // stores f32): nothing is copied before the file is written.
    let views = variables
        .iter()
        .map(|(k, t)| {
            TensorView::new(Dtype::F32, t.shape().dims().to_vec(), bytemuck::cast_slice(t.data()))
                .map(|v| (k.as_str(), v))
                .map_err(|e| {
                    RuntimeError::invalid(format!("checkpoint tensor `{k}`: {e}"), "report this as a bug")
                })
        })
        .collect::<Result<Vec<_>>>()?;
    write(path, views)
}

/// Writes `variables` (name, value) to `path` as safetensors of `dtype`: F32 as `save` does,
/// or a half copy, F16 or BF16, each value rounded to the nearest one of that type (ties to
/// even; beyond F16's range, infinite; NaN stays NaN). `read` widens such a file back to f32,
/// within half a unit in the last place of the half type of each value. A half copy is for
/// weights: every tensor is narrowed, counters too (bf16 holds integers exactly up to 256, f16
/// up to 2,048), so pass the parameters alone, or save a checkpoint to resume from with `save`.
pub fn save_as(path: &Path, variables: &[(String, HostTensor)], dtype: DType) -> Result<()> {
    let narrow: fn(f32) -> u16 = match dtype {
        DType::F32 => return save(path, variables),
        DType::F16 => |v| half::f16::from_f32(v).to_bits(),
        DType::BF16 => |v| half::bf16::from_f32(v).to_bits(),
        other => {
            return Err(RuntimeError::invalid(
                format!("a checkpoint of {other} variables"),
                "save as f32, f16 or bf16: kiln's variables are floats",
            ));
        }
    };
    let halves: Vec<Vec<u8>> = variables
        .iter()
        .map(|(_, t)| t.data().iter().flat_map(|&v| narrow(v).to_le_bytes()).collect())
        .collect();
    let stored = if dtype == DType::F16 { Dtype::F16 } else { Dtype::BF16 };
    let views = variables
        .iter()
        .zip(&halves)
        .map(|((k, t), bytes)| {
            TensorView::new(stored, t.shape().dims().to_vec(), bytes).map(|v| (k.as_str(), v)).map_err(|e| {
                RuntimeError::invalid(format!("checkpoint tensor `{k}`: {e}"), "report this as a bug")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    write(path, views)
}

/// `views` written to `path` with kiln's metadata.
fn write(path: &Path, views: Vec<(&str, TensorView<'_>)>) -> Result<()> {
    let metadata = HashMap::from([(FORMAT.0.to_string(), FORMAT.1.to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| {
        RuntimeError::invalid(
            format!("cannot write the checkpoint {}: {e}", path.display()),
            "check that the directory exists and is writable",
        )
    })
}

/// A checkpoint read from disk: its f32 tensors by name (F16 and BF16 ones widened to f32), and
/// the names of tensors of another dtype (with it), which no kiln variable can take.
#[derive(Debug)]
pub struct Checkpoint {
    /// The file's F32, F16 and BF16 tensors as f32, by name (a variable's key).
    pub tensors: BTreeMap<String, HostTensor>,
    /// The names of the tensors read from F16 or BF16, with that dtype as safetensors names it.
    pub widened: BTreeMap<String, String>,
    /// The names of the file's tensors of any other dtype, with that dtype as safetensors names
    /// it (e.g. `F64`, `I64`); their data is not read.
    pub other_dtypes: BTreeMap<String, String>,
}

/// One tensor's entry in a safetensors header, as `read` parsed it.
#[derive(Debug)]
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    begin: u64,
    end: u64,
}

/// Reads the safetensors file at `path`, after checking its header against every rule of the
/// format (see the module's doc): a file that breaks one is an error naming the tensor and the
/// rule, and no tensor data is read then.
pub fn read(path: &Path) -> Result<Checkpoint> {
    let io = |e: std::io::Error| {
        RuntimeError::invalid(format!("cannot read the checkpoint {}: {e}", path.display()), "check the path")
    };
    let malformed = |why: String| {
        RuntimeError::invalid(
            format!("{} is not a safetensors file: {why}", path.display()),
            "load a file written by `Trainer::save` (or any safetensors writer); this one is truncated, \
             damaged or of another format",
        )
    };
    let mut file = File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let header = read_header(&mut file, len).map_err(|e| match e {
        HeaderRead::Io(e) => io(e),
        HeaderRead::Malformed(why) => malformed(why),
        HeaderRead::Memory(bytes) => out_of_memory(bytes, "the checkpoint's header".into()),
    })?;
    let entries = parse_header(&header).map_err(malformed)?;
    let data_start = 8 + header.len() as u64;
    drop(header);
    check_layout(&entries, len - data_start).map_err(malformed)?;

    let mut tensors = BTreeMap::new();
    let mut widened = BTreeMap::new();
    let mut other_dtypes = BTreeMap::new();
    for e in entries {
        // F32 as it is, a half type widened.
        let widen: Option<fn(u16) -> f32> = match e.dtype.as_str() {
            "F32" => None,
            "F16" => Some(|b| half::f16::from_bits(b).to_f32()),
            "BF16" => Some(|b| half::bf16::from_bits(b).to_f32()),
            _ => {
                other_dtypes.insert(e.name, e.dtype);
                continue;
            }
        };
        // `check_layout` established that the range is the shape's elements times the dtype's
        // size (4 or 2 bytes) and lies inside the file.
        let size = if widen.is_some() { 2 } else { 4 };
        let n = usize::try_from((e.end - e.begin) / size)
            .map_err(|_| out_of_memory(usize::MAX, format!("tensor `{}`", e.name)))?;
        let mut data: Vec<f32> = Vec::new();
        data.try_reserve_exact(n)
            .map_err(|_| out_of_memory(n.saturating_mul(4), format!("tensor `{}`", e.name)))?;
        data.resize(n, 0.0);
        file.seek(SeekFrom::Start(data_start + e.begin)).map_err(io)?;
        if let Some(widen) = widen {
            // The half values land in the first half of the f32 buffer's bytes, then widen
            // from the last down, so that none is overwritten before it is read.
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut data);
            file.read_exact(&mut bytes[..2 * n]).map_err(io)?;
            for i in (0..n).rev() {
                let b = u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
                bytes[4 * i..4 * i + 4].copy_from_slice(&widen(b).to_ne_bytes());
            }
            widened.insert(e.name.clone(), e.dtype);
        } else {
            file.read_exact(bytemuck::cast_slice_mut(&mut data)).map_err(io)?;
            for v in &mut data {
                *v = f32::from_bits(u32::from_le(v.to_bits()));
            }
        }
        let dims = e.shape.iter().map(|&d| usize::try_from(d).unwrap_or(usize::MAX)).collect::<Vec<_>>();
        tensors.insert(e.name, HostTensor::new(Shape::new(dims), data)?);
    }
    Ok(Checkpoint { tensors, widened, other_dtypes })
}

/// The host could not reserve `bytes` for `what` of a checkpoint.
fn out_of_memory(bytes: usize, what: String) -> RuntimeError {
    RuntimeError::OutOfMemory {
        device: "host".into(),
        bytes,
        what: format!("{what} of a checkpoint"),
        detail: String::new(),
        help: "free host memory, or check that the file is the checkpoint meant".into(),
    }
}

/// Why the header could not be read.
enum HeaderRead {
    Io(std::io::Error),
    Malformed(String),
    Memory(usize),
}

/// The header's bytes, after checking its length (the file's first 8 bytes) against
/// [`MAX_HEADER_BYTES`] and the file's length `len`.
fn read_header(file: &mut File, len: u64) -> std::result::Result<Vec<u8>, HeaderRead> {
    if len < 8 {
        return Err(HeaderRead::Malformed(format!(
            "the file holds {len} bytes, fewer than the 8 bytes of the header length that starts a safetensors file"
        )));
    }
    let mut first = [0u8; 8];
    file.read_exact(&mut first).map_err(HeaderRead::Io)?;
    let n = u64::from_le_bytes(first);
    if n > MAX_HEADER_BYTES {
        return Err(HeaderRead::Malformed(format!(
            "the header length (the first 8 bytes, u64 little-endian) is {n} bytes, more than the \
             {MAX_HEADER_BYTES} bytes safetensors allows"
        )));
    }
    if n > len - 8 {
        return Err(HeaderRead::Malformed(format!(
            "the header length (the first 8 bytes, u64 little-endian) is {n} bytes, but only {} bytes \
             follow it in the file",
            len - 8
        )));
    }
    let n = n as usize; // at most MAX_HEADER_BYTES
    let mut header = Vec::new();
    header.try_reserve_exact(n).map_err(|_| HeaderRead::Memory(n))?;
    file.take(n as u64).read_to_end(&mut header).map_err(HeaderRead::Io)?;
    if header.len() != n {
        return Err(HeaderRead::Malformed(format!(
            "the file ended after {} of the header's {n} bytes",
            header.len()
        )));
    }
    Ok(header)
}

/// The size of one element of the safetensors dtype `name`, in bits; `None` for a name the
/// format does not define.
fn dtype_bits(name: &str) -> Option<u64> {
    Some(match name {
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// A JSON number as the header's integer fields read it.
enum Number {
    /// A non-negative integer that fits in 64 bits.
    Unsigned(u64),
    /// A negative number.
    Negative,
    /// A number with a fraction or an exponent.
    NotInteger,
    /// A non-negative integer of more than 64 bits.
    TooLarge,
}

/// A strict JSON reader over the header's bytes (RFC 8259), which reports the byte at which the
/// text stops being JSON.
struct Json<'a> {
    text: &'a [u8],
    at: usize,
}

impl Json<'_> {
    fn skip_whitespace(&mut self) {
        while matches!(self.text.get(self.at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// The next byte that is not whitespace (which is skipped).
    fn peek(&mut self) -> Option<u8> {
        self.skip_whitespace();
        self.text.get(self.at).copied()
    }

    /// What stands at the current byte, for messages.
    fn found(&self) -> String {
        match self.text.get(self.at) {
            None => "the end of the header".into(),
            Some(&c) if c.is_ascii_graphic() => format!("`{}`", c as char),
            Some(&c) => format!("byte 0x{c:02x}"),
        }
    }

    /// "The header is not valid JSON": `what`, and where.
    fn syntax(&self, what: &str) -> String {
        format!(
            "the header is not valid JSON: {what} at byte {} of the header (byte {} of the file)",
            self.at,
            self.at + 8
        )
    }

    fn expect(&mut self, byte: u8, what: &str) -> std::result::Result<(), String> {
        if self.peek() == Some(byte) {
            self.at += 1;
            Ok(())
        } else {
            Err(self.syntax(&format!("expected {what}, found {}", self.found())))
        }
    }

    /// What kind of JSON value starts at the next byte ("a string", "a number", ...).
    fn kind(&mut self) -> std::result::Result<&'static str, String> {
        Ok(match self.peek() {
            Some(b'"') => "a string",
            Some(b'{') => "an object",
            Some(b'[') => "an array",
            Some(b'-' | b'0'..=b'9') => "a number",
            _ if self.literal().is_some() => {
                if self.text[self.at] == b'n' {
                    "null"
                } else {
                    "a boolean"
                }
            }
            _ => return Err(self.syntax(&format!("expected a value, found {}", self.found()))),
        })
    }

    /// The length of the literal `true`, `false` or `null` at the current byte, if one is there.
    fn literal(&self) -> Option<usize> {
        let rest = self.text.get(self.at..)?;
        [&b"true"[..], b"false", b"null"].into_iter().find(|w| rest.starts_with(w)).map(<[u8]>::len)
    }

    /// After an item of an array or object: `true` at a `,`, `false` at `close`.
    fn more(&mut self, close: u8, what: &str) -> std::result::Result<bool, String> {
        match self.peek() {
            Some(b',') => {
                self.at += 1;
                Ok(true)
            }
            Some(c) if c == close => {
                self.at += 1;
                Ok(false)
            }
            _ => Err(self.syntax(&format!(
                "expected `,` or `{}` {what}, found {}",
                close as char,
                self.found()
            ))),
        }
    }

    fn hex4(&mut self) -> std::result::Result<u32, String> {
        let digits =
            self.text.get(self.at..self.at + 4).ok_or_else(|| self.syntax("unterminated `\\u` escape"))?;
        let s = std::str::from_utf8(digits).map_err(|_| self.syntax("invalid `\\u` escape"))?;
        let v = u32::from_str_radix(s, 16).map_err(|_| self.syntax("invalid `\\u` escape"))?;
        self.at += 4;
        Ok(v)
    }

    /// A string (the header is valid UTF-8, checked before).
    fn string(&mut self) -> std::result::Result<String, String> {
        self.expect(b'"', "a string")?;
        let mut out = Vec::new();
        loop {
            let Some(&c) = self.text.get(self.at) else {
                return Err(self.syntax("unterminated string"));
            };
            match c {
                b'"' => {
                    self.at += 1;
                    break;
                }
                b'\\' => {
                    self.at += 1;
                    let escaped = self.text.get(self.at).copied();
                    self.at += 1;
                    let ch = match escaped {
                        Some(b'"') => '"',
                        Some(b'\\') => '\\',
                        Some(b'/') => '/',
                        Some(b'b') => '\u{8}',
                        Some(b'f') => '\u{c}',
                        Some(b'n') => '\n',
                        Some(b'r') => '\r',
                        Some(b't') => '\t',
                        Some(b'u') => {
                            let high = self.hex4()?;
                            let code = if (0xD800..0xDC00).contains(&high) {
                                if self.text.get(self.at..self.at + 2) != Some(b"\\u") {
                                    return Err(self.syntax("a lone surrogate in a `\\u` escape"));
                                }
                                self.at += 2;
                                let low = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&low) {
                                    return Err(self.syntax("a lone surrogate in a `\\u` escape"));
                                }
                                0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00)
                            } else {
                                high
                            };
                            char::from_u32(code)
                                .ok_or_else(|| self.syntax("a lone surrogate in a `\\u` escape"))?
                        }
                        _ => {
                            self.at -= 1;
                            return Err(self.syntax("invalid escape in a string"));
                        }
                    };
                    out.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes());
                }
                0..=0x1f => return Err(self.syntax("a control character inside a string")),
                _ => {
                    out.push(c);
                    self.at += 1;
                }
            }
        }
        String::from_utf8(out).map_err(|_| self.syntax("a string that is not UTF-8"))
    }

    /// A number, as the header's integer fields see it.
    fn number(&mut self) -> std::result::Result<Number, String> {
        self.skip_whitespace();
        let negative = self.text.get(self.at) == Some(&b'-');
        if negative {
            self.at += 1;
        }
        let digits = |j: &mut Self| {
            let from = j.at;
            while matches!(j.text.get(j.at), Some(b'0'..=b'9')) {
                j.at += 1;
            }
            j.at - from
        };
        let int_start = self.at;
        let n = digits(self);
        if n == 0 {
            return Err(self.syntax("expected a digit"));
        }
        if n > 1 && self.text[int_start] == b'0' {
            self.at = int_start;
            return Err(self.syntax("a number with a leading zero"));
        }
        let int_end = self.at;
        let mut integer = true;
        if self.text.get(self.at) == Some(&b'.') {
            self.at += 1;
            integer = false;
            if digits(self) == 0 {
                return Err(self.syntax("expected a digit after `.`"));
            }
        }
        if matches!(self.text.get(self.at), Some(b'e' | b'E')) {
            self.at += 1;
            integer = false;
            if matches!(self.text.get(self.at), Some(b'+' | b'-')) {
                self.at += 1;
            }
            if digits(self) == 0 {
                return Err(self.syntax("expected a digit in an exponent"));
            }
        }
        let zero = self.text[int_start..int_end].iter().all(|&d| d == b'0');
        Ok(if negative && !(zero && integer) {
            Number::Negative
        } else if !integer {
            Number::NotInteger
        } else {
            // ASCII digits only, checked above.
            let s = std::str::from_utf8(&self.text[int_start..int_end]).unwrap_or_default();
            s.parse::<u64>().map_or(Number::TooLarge, Number::Unsigned)
        })
    }

    /// Skips one value of any kind (a header field `read` does not use).
    fn skip(&mut self, depth: usize) -> std::result::Result<(), String> {
        if depth > MAX_DEPTH {
            return Err(self.syntax(&format!("values nested deeper than {MAX_DEPTH} levels")));
        }
        match self.kind()? {
            "a string" => self.string().map(drop),
            "a number" => self.number().map(drop),
            "an object" => {
                self.at += 1;
                if self.peek() == Some(b'}') {
                    self.at += 1;
                    return Ok(());
                }
                loop {
                    self.string()?;
                    self.expect(b':', "`:`")?;
                    self.skip(depth + 1)?;
                    if !self.more(b'}', "in an object")? {
                        return Ok(());
                    }
                }
            }
            "an array" => {
                self.at += 1;
                if self.peek() == Some(b']') {
                    self.at += 1;
                    return Ok(());
                }
                loop {
                    self.skip(depth + 1)?;
                    if !self.more(b']', "in an array")? {
                        return Ok(());
                    }
                }
            }
            _ => {
                // `kind` found a literal there.
                self.at += self.literal().unwrap_or(0);
                Ok(())
            }
        }
    }

    /// An array of non-negative integers: field `field` of tensor `name`.
    fn integers(&mut self, name: &str, field: &str) -> std::result::Result<Vec<u64>, String> {
        let kind = self.kind()?;
        if kind != "an array" {
            return Err(format!(
                "tensor `{name}`: `{field}` is {kind}; it must be an array of non-negative integers"
            ));
        }
        self.at += 1;
        let mut out = Vec::new();
        if self.peek() == Some(b']') {
            self.at += 1;
            return Ok(out);
        }
        loop {
            let kind = self.kind()?;
            let i = out.len();
            if kind != "a number" {
                return Err(format!(
                    "tensor `{name}`: `{field}` entry {i} is {kind}; it must be a non-negative integer"
                ));
            }
            let why = match self.number()? {
                Number::Unsigned(v) => {
                    out.try_reserve(1)
                        .map_err(|_| format!("tensor `{name}`: `{field}` is too long to hold"))?;
                    out.push(v);
                    None
                }
                Number::Negative => Some("is negative"),
                Number::NotInteger => Some("is not an integer"),
                Number::TooLarge => Some("does not fit in 64 bits"),
            };
            if let Some(why) = why {
                return Err(format!(
                    "tensor `{name}`: `{field}` entry {i} {why}; shapes and data offsets are non-negative \
                     integers of at most 64 bits"
                ));
            }
            if !self.more(b']', &format!("in tensor `{name}`'s `{field}`"))? {
                return Ok(out);
            }
        }
    }

    /// The entry of tensor `name`: `{"dtype": .., "shape": [..], "data_offsets": [begin, end]}`.
    fn entry(&mut self, name: String) -> std::result::Result<Entry, String> {
        let kind = self.kind()?;
        if kind != "an object" {
            return Err(format!(
                "tensor `{name}`: its entry is {kind}; it must be an object with `dtype`, `shape` and \
                 `data_offsets`"
            ));
        }
        self.at += 1;
        let (mut dtype, mut shape, mut offsets) = (None, None, None);
        if self.peek() == Some(b'}') {
            self.at += 1;
        } else {
            loop {
                let field = self.string()?;
                self.expect(b':', "`:`")?;
                let seen = match field.as_str() {
                    "dtype" => {
                        let kind = self.kind()?;
                        if kind != "a string" {
                            return Err(format!(
                                "tensor `{name}`: `dtype` is {kind}; it must be a string such as \"F32\""
                            ));
                        }
                        dtype.replace(self.string()?).is_some()
                    }
                    "shape" => shape.replace(self.integers(&name, "shape")?).is_some(),
                    "data_offsets" => offsets.replace(self.integers(&name, "data_offsets")?).is_some(),
                    _ => {
                        self.skip(2)?;
                        false
                    }
                };
                if seen {
                    return Err(format!(
                        "tensor `{name}`: `{field}` appears twice in its entry (a duplicate key); each field is given once"
                    ));
                }
                if !self.more(b'}', &format!("in tensor `{name}`'s entry"))? {
                    break;
                }
            }
        }
        let missing = |field: &str| {
            format!(
                "tensor `{name}` has no `{field}`; every tensor needs `dtype`, `shape` and `data_offsets`"
            )
        };
        let dtype = dtype.ok_or_else(|| missing("dtype"))?;
        let shape = shape.ok_or_else(|| missing("shape"))?;
        let offsets = offsets.ok_or_else(|| missing("data_offsets"))?;
        let [begin, end] = offsets[..] else {
            return Err(format!(
                "tensor `{name}`: `data_offsets` holds {} numbers; it must hold two, [begin, end]",
                offsets.len()
            ));
        };
        Ok(Entry { name, dtype, shape, begin, end })
    }

    /// The `__metadata__` object: strings to strings (or null).
    fn metadata(&mut self) -> std::result::Result<(), String> {
        let kind = self.kind()?;
        if kind == "null" {
            return self.skip(0);
        }
        if kind != "an object" {
            return Err(format!("`__metadata__` is {kind}; it must be an object mapping strings to strings"));
        }
        self.at += 1;
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Ok(());
        }
        let mut keys = HashMap::new();
        loop {
            let at = self.at;
            let key = self.string()?;
            self.expect(b':', "`:`")?;
            let kind = self.kind()?;
            if kind != "a string" {
                return Err(format!(
                    "`__metadata__` value of `{key}` is {kind}, not a string; safetensors metadata maps \
                     strings to strings"
                ));
            }
            self.string()?;
            if let Some(first) = keys.insert(key.clone(), at) {
                return Err(format!(
                    "`__metadata__` key `{key}` appears twice (bytes {first} and {at} of the header): \
                     duplicate keys are not allowed"
                ));
            }
            if !self.more(b'}', "in `__metadata__`")? {
                return Ok(());
            }
        }
    }
}

/// The tensors of a safetensors header, in the header's order, after the JSON rules (see the
/// module's doc); the layout rules are `check_layout`'s.
fn parse_header(text: &[u8]) -> std::result::Result<Vec<Entry>, String> {
    if let Err(e) = std::str::from_utf8(text) {
        let at = e.valid_up_to();
        return Err(format!(
            "the header is not valid UTF-8: byte {at} of the header (byte {} of the file) is 0x{:02x}",
            at + 8,
            text[at]
        ));
    }
    let mut j = Json { text, at: 0 };
    if j.peek() != Some(b'{') {
        return Err(j.syntax(&format!("the header must be a JSON object, found {}", j.found())));
    }
    j.at += 1;
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut entries = Vec::new();
    let mut metadata_at = None;
    if j.peek() == Some(b'}') {
        j.at += 1;
    } else {
        loop {
            if j.peek() != Some(b'"') {
                return Err(j.syntax(&format!("expected a tensor name (a string), found {}", j.found())));
            }
            let at = j.at;
            let name = j.string()?;
            j.expect(b':', "`:`")?;
            if name == "__metadata__" {
                if let Some(first) = metadata_at.replace(at) {
                    return Err(format!(
                        "`__metadata__` appears twice in the header (bytes {first} and {at}): duplicate \
                         keys are not allowed"
                    ));
                }
                j.metadata()?;
            } else {
                if let Some(&first) = names.get(&name) {
                    return Err(format!(
                        "tensor `{name}` appears twice in the header (bytes {first} and {at}): duplicate \
                         tensor names are not allowed (a reader would keep one of them silently)"
                    ));
                }
                let entry = j.entry(name.clone())?;
                let full = "the header has too many tensors to hold".to_string();
                names.try_reserve(1).map_err(|_| full.clone())?;
                entries.try_reserve(1).map_err(|_| full)?;
                names.insert(name, at);
                entries.push(entry);
            }
            if !j.more(b'}', "after a header entry")? {
                break;
            }
        }
    }
    if j.peek().is_some() {
        return Err(j.syntax(&format!("{} after the header's JSON object", j.found())));
    }
    Ok(entries)
}

/// Checks each entry's dtype, shape and range, and that the entries tile the `data_len` bytes
/// of data after the header exactly (see the module's doc).
fn check_layout(entries: &[Entry], data_len: u64) -> std::result::Result<(), String> {
    for e in entries {
        let name = &e.name;
        let bits = dtype_bits(&e.dtype).ok_or_else(|| {
            format!("tensor `{name}` has dtype `{}`, which safetensors does not define", e.dtype)
        })?;
        let overflow = || {
            format!(
                "tensor `{name}`: shape {:?} of {} overflows: the product of its dimensions (times the \
                 dtype's size) does not fit in 64 bits",
                e.shape, e.dtype
            )
        };
        let numel = e.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).ok_or_else(overflow)?;
        let total_bits = numel.checked_mul(bits).ok_or_else(overflow)?;
        if usize::try_from(numel).is_err() {
            return Err(overflow());
        }
        if total_bits % 8 != 0 {
            return Err(format!(
                "tensor `{name}`: shape {:?} of {} is not a whole number of bytes",
                e.shape, e.dtype
            ));
        }
        let bytes = total_bits / 8;
        if e.begin > e.end {
            return Err(format!(
                "tensor `{name}`: data_offsets [{}, {}] are reversed: the begin is after the end",
                e.begin, e.end
            ));
        }
        if e.end - e.begin != bytes {
            return Err(format!(
                "tensor `{name}`: data_offsets [{}, {}] span {} bytes, but shape {:?} of {} takes {bytes} \
                 bytes ({numel} elements of {bits} bits): the byte range disagrees with the shape and dtype",
                e.begin,
                e.end,
                e.end - e.begin,
                e.shape,
                e.dtype
            ));
        }
    }
    let mut order: Vec<&Entry> = Vec::new();
    order
        .try_reserve_exact(entries.len())
        .map_err(|_| "the header has too many tensors to hold".to_string())?;
    order.extend(entries);
    order.sort_by_key(|e| (e.begin, e.end));
    let mut covered = 0u64;
    let mut previous: Option<&Entry> = None;
    for e in &order {
        if e.begin > covered {
            return Err(match previous {
                None => format!(
                    "bytes 0..{} of the data come before the first tensor `{}` and belong to no tensor \
                     (a gap in data_offsets: the tensors must cover the data exactly)",
                    e.begin, e.name
                ),
                Some(p) => format!(
                    "bytes {covered}..{} of the data, between tensor `{}` and tensor `{}`, belong to no \
                     tensor (a gap in data_offsets: the tensors must cover the data exactly)",
                    e.begin, p.name, e.name
                ),
            });
        }
        if let Some(p) = previous.filter(|_| e.begin < covered) {
            return Err(format!(
                "tensor `{}` (data bytes {}..{}) and tensor `{}` (data bytes {}..{}) overlap: data_offsets \
                 must give each byte to one tensor",
                p.name, p.begin, p.end, e.name, e.begin, e.end
            ));
        }
        covered = e.end;
        previous = Some(e);
    }
    if covered > data_len {
        let cut: Vec<&&Entry> = order.iter().filter(|e| e.end > data_len).collect();
        let first = cut[0];
        let have = data_len.saturating_sub(first.begin);
        let mut why = format!(
            "the file is truncated: tensor `{}` needs data bytes {}..{} but the file holds {data_len} bytes \
             of data after the header, so {} of its {} bytes are missing",
            first.name,
            first.begin,
            first.end,
            first.end - first.begin - have,
            first.end - first.begin
        );
        if cut.len() > 1 {
            let names: Vec<String> = cut[1..].iter().take(5).map(|e| format!("`{}`", e.name)).collect();
            why.push_str(&format!(
                ", and {} more tensor{} ({}{}) {} wholly past the end",
                cut.len() - 1,
                plural(cut.len() - 1),
                names.join(", "),
                if cut.len() > 6 { ", ..." } else { "" },
                if cut.len() == 2 { "lies" } else { "lie" }
            ));
        }
        why.push_str(&format!(" ({} bytes missing in all)", covered - data_len));
        return Err(why);
    }
    if covered < data_len {
        return Err(match previous {
            Some(p) => format!(
                "{} bytes of data after the last tensor `{}` (data bytes {covered}..{data_len}) belong to no \
                 tensor: the tensors must cover the data exactly",
                data_len - covered,
                p.name
            ),
            None => format!("the header names no tensor but {data_len} bytes of data follow it"),
        });
    }
    Ok(())
}

/// `"s"` unless `n` is 1.
fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

impl Checkpoint {
    /// Every difference between this file and the variables `expected` (name and shape): names
    /// the model has and the file lacks, names the file has and the model lacks, shapes and
    /// dtypes that differ. Empty when the file fits.
    pub fn differences(&self, expected: &BTreeMap<String, Shape>) -> Vec<String> {
        self.differences_ignoring(expected, |_| false)
    }

    /// As [`differences`](Self::differences), except that the file's names outside `expected`
    /// for which `ignore` holds are not differences (`Trainer::load_weights` ignores the
    /// optimizer's state).
    pub fn differences_ignoring(
        &self,
        expected: &BTreeMap<String, Shape>,
        ignore: impl Fn(&str) -> bool,
    ) -> Vec<String> {
        let mut out = Vec::new();
        for (key, shape) in expected {
            match (self.tensors.get(key), self.other_dtypes.get(key)) {
                (Some(t), _) if t.shape() != shape => {
                    out.push(format!("`{key}` is {} in the file, {shape} in the model", t.shape()))
                }
                (Some(_), _) => {}
                (None, Some(dtype)) => out
                    .push(format!("`{key}` is {dtype} in the file; kiln reads F32, F16 and BF16 variables")),
                (None, None) => out.push(format!("`{key}` ({shape}) is missing from the file")),
            }
        }
        for key in self.tensors.keys().chain(self.other_dtypes.keys()) {
            if !expected.contains_key(key) && !ignore(key) {
                out.push(format!("`{key}` is in the file but not in the model"));
            }
        }
        out
    }

    /// The file's f32 tensors that hold NaN or infinite values, by name, with how many each
    /// holds, in name order. Empty when every value is finite. A model loaded from such a file
    /// computes a NaN loss on its next step, so `Trainer::load` and `load_weights` warn.
    pub fn non_finite(&self) -> Vec<(String, usize)> {
        non_finite(self.tensors.iter().map(|(k, t)| (k.as_str(), t)))
    }
}

/// The tensors of `tensors` (name, value) that hold NaN or infinite values, with how many each
/// holds, in the given order; empty when every value is finite.
pub fn non_finite<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a HostTensor)>) -> Vec<(String, usize)> {
    tensors
        .into_iter()
        .filter_map(|(k, t)| {
            let n = t.data().iter().filter(|v| !v.is_finite()).count();
            (n > 0).then(|| (k.to_string(), n))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(header: &str) -> std::result::Result<Vec<String>, String> {
        parse_header(header.as_bytes()).map(|e| e.into_iter().map(|e| e.name).collect())
    }

    fn entry(name: &str) -> String {
        format!(r#""{name}":{{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#)
    }

    #[test]
    fn header_strings_decode_escapes_and_refuse_lone_surrogates() {
        assert_eq!(names(&format!("{{{}}}", entry(r"a\u00e9\/\n\ud83d\ude00"))).unwrap(), ["aé/\n😀"]);
        let e = names(&format!("{{{}}}", entry(r"a\ud83d"))).unwrap_err();
        assert!(e.contains("lone surrogate"), "{e}");
        let e = names(&format!("{{{}}}", entry(r"a\q"))).unwrap_err();
        assert!(e.contains("invalid escape") && e.contains("byte 4 of the header"), "{e}");
        let e = names("{\"a\tb\":1}").unwrap_err();
        assert!(e.contains("control character"), "{e}");
    }

    #[test]
    fn header_numbers_are_strict_json() {
        let with = |offsets: &str| {
            names(&format!(r#"{{"t":{{"dtype":"F32","shape":[1],"data_offsets":{offsets}}}}}"#))
        };
        assert!(with("[0,4]").is_ok());
        assert!(with("[-0,4]").is_ok());
        assert!(with("[00,4]").unwrap_err().contains("leading zero"));
        assert!(with("[0,4.]").unwrap_err().contains("after `.`"));
        assert!(with("[0,4e]").unwrap_err().contains("exponent"));
        assert!(with("[0,-]").unwrap_err().contains("expected a digit"));
        assert!(with("[0,4.5]").unwrap_err().contains("is not an integer"));
    }

    #[test]
    fn unknown_fields_are_skipped_and_empty_headers_read() {
        let header = r#" { "__metadata__" : null , "t" : { "x" : [ { "y" : true } , false , null , "s" , -1.5e3 ] ,
            "dtype" : "F32" , "shape" : [ 1 ] , "data_offsets" : [ 0 , 4 ] } }   "#;
        assert_eq!(names(header).unwrap(), ["t"]);
        assert!(names("{}").unwrap().is_empty());
        assert!(names("").unwrap_err().contains("must be a JSON object"));
        assert!(names(r#"{"t":{"x":nul}}"#).unwrap_err().contains("expected a value"));
    }

    #[test]
    fn layout_rules_hold_for_zero_sized_and_sub_byte_tensors() {
        let entry = |name: &str, dtype: &str, shape: Vec<u64>, begin, end| Entry {
            name: name.into(),
            dtype: dtype.into(),
            shape,
            begin,
            end,
        };
        // An empty tensor between two others takes no bytes.
        let ok = [
            entry("a", "F32", vec![1], 0, 4),
            entry("e", "F32", vec![0, 3], 4, 4),
            entry("b", "U8", vec![2], 4, 6),
        ];
        assert!(check_layout(&ok, 6).is_ok());
        assert!(check_layout(&[entry("f", "F4", vec![4], 0, 2)], 2).is_ok());
        let e = check_layout(&[entry("f", "F4", vec![3], 0, 2)], 2).unwrap_err();
        assert!(e.contains("`f`") && e.contains("not a whole number of bytes"), "{e}");
        let e = check_layout(&[], 3).unwrap_err();
        assert!(e.contains("names no tensor but 3 bytes"), "{e}");
    }
}
