//! DLPack in and out: kiln's tensors exchanged with other libraries (PyTorch, JAX, CuPy, NumPy)
//! through DLPack's C ABI, `DLManagedTensor`.
//!
//! - **Out, without a copy**: `CpuBackend::output_dlpack` / `CudaBackend::output_dlpack` describe
//!   an output where the plan left it (in the arena, on the CPU or the CUDA device), and
//!   `variable_dlpack` a variable in its region. The view borrows the backend, so Rust cannot run
//!   the program again (which would overwrite the arena) while it is alive; handed to C with
//!   `into_raw`, the consumer must be done before the next run, as with PyTorch's `.numpy()`.
//!   `HostTensor::into_dlpack`-style export of host data is `dlpack_from_host` (the tensor's
//!   buffer moves into the managed tensor: no copy for f32).
//! - **In**: `host_from_dlpack` copies a contiguous CPU tensor of f32, i32, i64 or bool into a
//!   `HostTensor`; `CpuBackend::run_with` runs a program with inputs bound to DLPack tensors in
//!   place (no copy: the steps read the caller's memory) when the tensor is contiguous, on the
//!   CPU, aligned, and of the input's dtype and shape, and the plan never writes over that input.
//!   Anything else is an error that says which of those fails.
//!
//! The ABI's four structs are declared here rather than taken from a crate: they are fixed by
//! the DLPack standard (v0.8 `DLManagedTensor`, which every framework reads), while the Rust
//! crates that wrap them (`dlpark`'s 0.7 / 0.8-alpha / 0.9-alpha) changed their API at each
//! release.

use crate::error::{Result, RuntimeError};
use crate::tensor::HostTensor;
use kiln_compiler::ir::{DType, Shape};
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ptr::NonNull;

/// `DLDeviceType` `kDLCPU`: host memory.
pub const KDL_CPU: i32 = 1;
/// `DLDeviceType` `kDLCUDA`: CUDA device memory.
pub const KDL_CUDA: i32 = 2;
/// `DLDataTypeCode` `kDLInt`: signed integers (kiln's i32 and i64).
pub const KDL_INT: u8 = 0;
/// `DLDataTypeCode` `kDLFloat`: IEEE floating point (kiln's f32).
pub const KDL_FLOAT: u8 = 2;
/// `DLDataTypeCode` `kDLBool`: booleans, one byte each (kiln's bool).
pub const KDL_BOOL: u8 = 6;
/// `kDLBfloat`: bfloat16, 16 bits.
pub const KDL_BFLOAT: u8 = 4;

/// DLPack's `DLDevice`: where a tensor's memory lives.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    /// The kind of device: [`KDL_CPU`] or [`KDL_CUDA`] for the tensors kiln makes.
    pub device_type: i32,
    /// The device's ordinal within its kind (0 for the CPU, the CUDA device number otherwise).
    pub device_id: i32,
}

/// DLPack's `DLDataType`: an element type as a type code, a width and a vector length.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    /// The type code: [`KDL_INT`], [`KDL_FLOAT`] or [`KDL_BOOL`] for the dtypes kiln exchanges.
    pub code: u8,
    /// The width of one lane in bits (32 for f32 and i32, 64 for i64, 8 for bool).
    pub bits: u8,
    /// The number of lanes per element; kiln exchanges scalars only (1).
    pub lanes: u16,
}

/// DLPack's `DLTensor`: a borrowed description of an n-dimensional array.
#[repr(C)]
pub struct DLTensor {
    /// The base address of the memory (a host pointer, or a device pointer for CUDA).
    pub data: *mut c_void,
    /// Where the memory lives.
    pub device: DLDevice,
    /// The number of dimensions (0 for a scalar).
    pub ndim: i32,
    /// The element type.
    pub dtype: DLDataType,
    /// `ndim` dimension sizes, in elements.
    pub shape: *mut i64,
    /// Null: compact row-major.
    /// Otherwise `ndim` strides, in elements (not bytes).
    pub strides: *mut i64,
    /// The offset of the first element from `data`, in bytes.
    pub byte_offset: u64,
}

/// DLPack's `DLManagedTensor`: a [`DLTensor`] with the deleter that frees it, the unit that
/// changes hands between libraries.
#[repr(C)]
pub struct DLManagedTensor {
    /// The tensor's description.
    pub dl_tensor: DLTensor,
    /// The producer's private context, for its deleter (kiln's holds the shape and any owned data).
    pub manager_ctx: *mut c_void,
    /// Frees the tensor and its context; called once by whoever holds it last (None: nothing to
    /// free).
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// kiln's dtype in DLPack's terms.
pub fn dl_dtype(dtype: DType) -> Result<DLDataType> {
    let (code, bits) = match dtype {
        DType::F32 => (KDL_FLOAT, 32),
        DType::I32 => (KDL_INT, 32),
        DType::I64 => (KDL_INT, 64),
        DType::Bool => (KDL_BOOL, 8),
        DType::F16 => (KDL_FLOAT, 16),
        DType::BF16 => (KDL_BFLOAT, 16),
    };
    Ok(DLDataType { code, bits, lanes: 1 })
}

/// DLPack's dtype in kiln's terms.
pub fn kiln_dtype(t: DLDataType) -> Result<DType> {
    match (t.code, t.bits, t.lanes) {
        (KDL_FLOAT, 32, 1) => Ok(DType::F32),
        (KDL_INT, 32, 1) => Ok(DType::I32),
        (KDL_INT, 64, 1) => Ok(DType::I64),
        (KDL_BOOL, 8, 1) => Ok(DType::Bool),
        (KDL_FLOAT, 16, 1) => Ok(DType::F16),
        (KDL_BFLOAT, 16, 1) => Ok(DType::BF16),
        _ => Err(RuntimeError::invalid(
            format!("DLPack dtype code {} bits {} lanes {} has no kiln dtype", t.code, t.bits, t.lanes),
            "pass float32, float16, bfloat16, int32, int64 or bool tensors (cast them first)",
        )),
    }
}

/// What a managed tensor made by kiln owns: its shape, and the data when it owns it.
struct Context {
    shape: Vec<i64>,
    _data: Option<Box<dyn std::any::Any>>,
}

unsafe extern "C" fn delete(t: *mut DLManagedTensor) {
    // SAFETY: `t` was made by `managed` below (Box::into_raw), its context by Box::into_raw of a
    // `Context`, and DLPack calls the deleter once.
    unsafe {
        drop(Box::from_raw((*t).manager_ctx as *mut Context));
        drop(Box::from_raw(t));
    }
}

fn managed(
    data: *mut c_void,
    device: DLDevice,
    dtype: DType,
    shape: &Shape,
    owned: Option<Box<dyn std::any::Any>>,
) -> Result<NonNull<DLManagedTensor>> {
    let mut ctx = Box::new(Context { shape: shape.dims().iter().map(|&d| d as i64).collect(), _data: owned });
    let t = Box::new(DLManagedTensor {
        dl_tensor: DLTensor {
            data,
            device,
            ndim: shape.rank() as i32,
            dtype: dl_dtype(dtype)?,
            shape: ctx.shape.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: std::ptr::null_mut(),
        deleter: Some(delete),
    });
    let t = Box::into_raw(t);
    // SAFETY: `t` is a fresh, valid box; the context box outlives it (freed by `delete`).
    unsafe { (*t).manager_ctx = Box::into_raw(ctx) as *mut c_void };
    Ok(NonNull::new(t).expect("Box::into_raw is never null"))
}

/// A DLPack tensor this side holds: its deleter runs on drop (unless handed on with `into_raw`).
/// `'a` is what the memory borrows (a backend's arena or variables), `'static` when owned.
pub struct Dlpack<'a> {
    raw: NonNull<DLManagedTensor>,
    _borrow: PhantomData<&'a ()>,
}

impl Drop for Dlpack<'_> {
    fn drop(&mut self) {
        // SAFETY: `raw` is a live managed tensor this value owns; its deleter frees it once.
        unsafe {
            if let Some(d) = self.raw.as_ref().deleter {
                d(self.raw.as_ptr());
            }
        }
    }
}

impl<'a> Dlpack<'a> {
    /// Takes ownership of a managed tensor from another library (its deleter runs on drop).
    ///
    /// # Safety
    /// `raw` is a valid `DLManagedTensor` whose fields describe live memory, not owned elsewhere.
    pub unsafe fn from_raw(raw: *mut DLManagedTensor) -> Result<Dlpack<'static>> {
        let raw = NonNull::new(raw).ok_or_else(|| RuntimeError::invalid("a null DLPack tensor", ""))?;
        Ok(Dlpack { raw, _borrow: PhantomData })
    }

    /// Hands the managed tensor to another library, which calls its deleter.
    pub fn into_raw(self) -> *mut DLManagedTensor {
        let raw = self.raw.as_ptr();
        std::mem::forget(self);
        raw
    }

    fn tensor(&self) -> &DLTensor {
        // SAFETY: `raw` is live while `self` is.
        unsafe { &self.raw.as_ref().dl_tensor }
    }

    /// The first element's address (data + byte_offset).
    pub fn data_ptr(&self) -> u64 {
        self.tensor().data as u64 + self.tensor().byte_offset
    }

    /// Where the tensor's memory lives (device type and ordinal).
    pub fn device(&self) -> DLDevice {
        self.tensor().device
    }

    /// The element type in kiln's terms; an error for a DLPack type kiln has no dtype for.
    pub fn dtype(&self) -> Result<DType> {
        kiln_dtype(self.tensor().dtype)
    }

    /// The shape, in elements; an error when the rank is negative, the shape pointer is null or a
    /// dimension is negative.
    pub fn shape(&self) -> Result<Shape> {
        let t = self.tensor();
        if t.ndim < 0 || (t.ndim > 0 && t.shape.is_null()) {
            return Err(RuntimeError::invalid(
                format!("a DLPack tensor of rank {} without a shape", t.ndim),
                "",
            ));
        }
        // SAFETY: DLPack promises `ndim` dims at `shape`.
        let dims = unsafe { std::slice::from_raw_parts(t.shape, t.ndim as usize) };
        if dims.iter().any(|&d| d < 0) {
            return Err(RuntimeError::invalid(
                format!("a DLPack shape with a negative dimension: {dims:?}"),
                "",
            ));
        }
        Ok(Shape::new(dims.iter().map(|&d| d as usize).collect::<Vec<_>>()))
    }

    /// Whether the elements are compact and row-major (no strides, or the row-major ones; a
    /// dimension of size 1 may have any stride).
    pub fn is_contiguous(&self) -> Result<bool> {
        let t = self.tensor();
        if t.strides.is_null() {
            return Ok(true);
        }
        let shape = self.shape()?;
        // SAFETY: DLPack promises `ndim` strides at `strides` when it is not null.
        let strides = unsafe { std::slice::from_raw_parts(t.strides, t.ndim as usize) };
        let mut want = 1i64;
        for (&d, &s) in shape.dims().iter().zip(strides).rev() {
            if d != 1 && s != want {
                return Ok(false);
            }
            want *= d as i64;
        }
        Ok(true)
    }

    /// The checks every in-place or copied import makes: contiguous, on `device`, of a kiln
    /// dtype, aligned for it; returns its dtype and shape.
    pub fn check_for(&self, device: DLDevice) -> Result<(DType, Shape)> {
        let (dtype, shape) = (self.dtype()?, self.shape()?);
        if !self.is_contiguous()? {
            return Err(RuntimeError::invalid(
                format!("the DLPack tensor {dtype}{shape} is strided, not contiguous"),
                "make it contiguous first (`.contiguous()` in PyTorch), or copy it",
            ));
        }
        if self.device() != device {
            let d = self.device();
            return Err(RuntimeError::invalid(
                format!(
                    "the DLPack tensor is on device type {} id {}, not type {} id {}",
                    d.device_type, d.device_id, device.device_type, device.device_id
                ),
                "move it to the device first (`.cpu()` / `.cuda(i)`), or copy it",
            ));
        }
        if !self.data_ptr().is_multiple_of(dtype.size_bytes() as u64) {
            return Err(RuntimeError::invalid(
                format!("the DLPack tensor's data at {:#x} is not aligned for {dtype}", self.data_ptr()),
                "copy it",
            ));
        }
        Ok((dtype, shape))
    }
}

/// The CPU as DLPack names it.
pub const CPU: DLDevice = DLDevice { device_type: KDL_CPU, device_id: 0 };

/// A view of memory a backend holds (no copy), borrowing the backend for `'a`.
///
/// # Safety
/// `ptr` holds `shape`'s elements of `dtype` for as long as `'a`.
pub(crate) unsafe fn view<'a>(ptr: u64, device: DLDevice, dtype: DType, shape: &Shape) -> Result<Dlpack<'a>> {
    Ok(Dlpack { raw: managed(ptr as *mut c_void, device, dtype, shape, None)?, _borrow: PhantomData })
}

/// `t`'s data as an owned DLPack tensor on the CPU: an f32 tensor's buffer moves in (no copy);
/// i32, i64 and bool tensors are written once as their dtype's bytes.
pub fn dlpack_from_host(t: HostTensor) -> Result<Dlpack<'static>> {
    let (dtype, shape) = (t.dtype(), t.shape().clone());
    let (data, owned): (*mut c_void, Box<dyn std::any::Any>) = if dtype == DType::F32 {
        let mut v = t.into_data();
        (v.as_mut_ptr() as *mut c_void, Box::new(v))
    } else {
        let bytes = t.to_bytes()?;
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(&bytes);
        (words.as_mut_ptr() as *mut c_void, Box::new(words))
    };
    Ok(Dlpack { raw: managed(data, CPU, dtype, &shape, Some(owned))?, _borrow: PhantomData })
}

/// A copy of a contiguous CPU DLPack tensor as a `HostTensor` of its dtype (a float16 or
/// bfloat16 tensor widened to f32, exactly).
pub fn host_from_dlpack(t: &Dlpack<'_>) -> Result<HostTensor> {
    let (dtype, shape) = t.check_for(CPU)?;
    let n = shape.checked_numel().and_then(|n| n.checked_mul(dtype.size_bytes())).ok_or_else(|| {
        RuntimeError::invalid(
            format!("the DLPack tensor {dtype}{shape} holds more bytes than a usize counts"),
            "",
        )
    })?;
    if n == 0 {
        return HostTensor::from_bytes(shape, dtype, &[]);
    }
    // SAFETY: `check_for` established a contiguous CPU tensor of `shape` and `dtype`: `n` bytes
    // from its first element.
    let bytes = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, n) };
    HostTensor::from_bytes(shape, dtype, bytes)
}

/// The alignment an input bound in place needs: what the kernels' vector loads assume of a slot.
pub const BIND_ALIGNMENT: u64 = 16;

/// Checks that `t` may stand for input `name` of `plan` in place on `device` (contiguous, on the
/// device, aligned to `BIND_ALIGNMENT`, of the input's dtype and shape, and an input no step
/// writes over); returns
/// the input's buffer and value and the tensor's address.
pub(crate) fn bindable(
    plan: &kiln_compiler::Plan,
    name: &str,
    t: &Dlpack<'_>,
    device: DLDevice,
) -> Result<(usize, usize, u64)> {
    let b = plan.input(name).ok_or_else(|| {
        RuntimeError::invalid(
            format!("plan {:?} has no input `{name}`", plan.name),
            "bind its inputs by name",
        )
    })?;
    let v = plan.value(b.value);
    let (dtype, shape) = t.check_for(device)?;
    if dtype != v.dtype || shape != v.shape {
        return Err(RuntimeError::InputShape {
            name: name.into(),
            expected: v.shape.clone(),
            expected_dtype: v.dtype,
            got: shape,
            dtype,
            help: "bind a tensor of the input's dtype and shape".into(),
        });
    }
    // The kernels read the slots they are given as 16-byte vectors (float4 loads of plain
    // operands on CUDA, SIMD on the CPU): a bound tensor must sit where a slot could.
    if !t.data_ptr().is_multiple_of(BIND_ALIGNMENT) {
        return Err(RuntimeError::invalid(
            format!(
                "the DLPack tensor for input `{name}` starts at {:#x}, not at a multiple of {BIND_ALIGNMENT} bytes: kiln's kernels read inputs as {BIND_ALIGNMENT}-byte vectors",
                t.data_ptr()
            ),
            "feed it by copy (set_input_dlpack / call), or bind a tensor that starts its allocation (`.clone()` in PyTorch)",
        ));
    }
    if plan.steps.iter().filter_map(|s| s.output).any(|o| plan.values[o].buffer == v.buffer) {
        return Err(RuntimeError::invalid(
            format!(
                "plan {:?} writes over its input `{name}` in place: binding it would change your tensor",
                plan.name
            ),
            "feed it by copy (set_input / call)",
        ));
    }
    // Every operand read from the input's buffer is read from the caller's tensor instead: each
    // must lie inside the input's own bytes (a plan may place other values in the buffer).
    let bytes = v.shape.numel() * v.dtype.size_bytes();
    let outside = plan.values.iter().any(|w| {
        w.buffer == v.buffer && w.offset.saturating_add(w.shape.numel() * w.dtype.size_bytes()) > bytes
    });
    if outside {
        return Err(RuntimeError::invalid(
            format!(
                "plan {:?} reads values past input `{name}`'s {bytes} bytes in its buffer: binding it would read past your tensor",
                plan.name
            ),
            "feed it by copy (set_input / call)",
        ));
    }
    Ok((v.buffer, b.value, t.data_ptr()))
}
