//! DLPack in and out (`kiln::runtime::dlpack`): outputs and variables exported without a copy
//! (the data pointer is the arena's or the variable's), host tensors round-tripped, inputs bound
//! in place on the CPU (the steps read the caller's tensor: same results, the same pointer), fed
//! by copy on the CUDA backend (the emulated device, and the GPU where there is one), and strided, foreign-device, wrongly typed or
//! written-over tensors refused with an error that says which.

mod common;

use kiln::compiler::ir::DType;
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::runtime::cuda::{self, CudaBackend};
use kiln::runtime::dlpack::{self, CPU, DLDevice, Dlpack, KDL_CUDA, dlpack_from_host, host_from_dlpack};
use kiln::runtime::memory::Tracker;
use kiln::zoo;

fn forward() -> Plan {
    let t = Tracer::new("affine");
    let x = t.input("x", [4, 3]);
    let w = t.param("w", [3, 2], Init::GlorotUniform);
    t.output("y", &x.matmul(&w).relu());
    compile(t.finish().unwrap(), &CompileOptions::default()).unwrap()
}

fn x() -> HostTensor {
    HostTensor::from_fn([4, 3], |i| i as f32 / 6.0 - 0.9).unwrap()
}

#[test]
fn host_tensors_round_trip_through_dlpack() {
    let t = x();
    let data = t.data().as_ptr() as u64;
    let d = dlpack_from_host(t).unwrap();
    assert_eq!(d.data_ptr(), data, "an f32 tensor's buffer moves in: no copy");
    assert_eq!((d.dtype().unwrap(), d.shape().unwrap(), d.device()), (DType::F32, Shape::new([4, 3]), CPU));
    assert_eq!(host_from_dlpack(&d).unwrap(), x());
    for t in [
        HostTensor::from_i64([2, 2], vec![1, -2, 1 << 40, 3]).unwrap(),
        HostTensor::from_i32([3], vec![7, -7, 0]).unwrap(),
        HostTensor::from_bool([2], vec![true, false]).unwrap(),
    ] {
        let back = host_from_dlpack(&dlpack_from_host(t.clone()).unwrap()).unwrap();
        assert_eq!(back, t, "{:?}", t.dtype());
    }
    // Handed to C and taken back: the deleter runs once (no leak, no double free under Miri-like use).
    let raw = dlpack_from_host(x()).unwrap().into_raw();
    let again = unsafe { Dlpack::from_raw(raw) }.unwrap();
    assert_eq!(host_from_dlpack(&again).unwrap(), x());
    assert!(unsafe { Dlpack::from_raw(std::ptr::null_mut()) }.is_err());
}

#[test]
fn outputs_and_variables_leave_without_a_copy_and_inputs_bind_in_place_on_the_cpu() {
    let mut b = CpuBackend::new(3);
    let id = b.load(forward()).unwrap();
    let want = b.call(id, &[("x", &x())]).unwrap().remove(0).1;
    {
        let y = b.output_dlpack(id, "y").unwrap();
        assert_eq!(host_from_dlpack(&y).unwrap(), want);
        let w = b.variable_dlpack("w").unwrap();
        assert_eq!(host_from_dlpack(&w).unwrap(), b.read_variable("w").unwrap());
    }
    // Bound in place: the plan reads the caller's tensor. Shown with the arena in a region we can
    // see: after feeding x by copy, running with another tensor bound leaves x's slot as it was
    // and computes from the bound tensor.
    let input = dlpack_from_host(x()).unwrap();
    b.run_with(id, &[("x", &input)]).unwrap();
    assert_eq!(b.output(id, "y").unwrap(), want);
    let plan = forward();
    let (xo, xn) = kiln::runtime::owned_memory::io_offset(&plan, "x").unwrap();
    let bytes = plan.memory.arena_bytes;
    let raw: &'static mut [u8] = Box::leak(vec![0u8; bytes + 4096].into_boxed_slice());
    let skip = (4096 - raw.as_ptr() as usize % 4096) % 4096;
    let region = &mut raw[skip..skip + bytes];
    let base = region.as_ptr();
    let mut seen = CpuBackend::new(3);
    let sid = seen.load_into(plan, region).unwrap();
    seen.call(sid, &[("x", &x())]).unwrap();
    let before = unsafe { std::slice::from_raw_parts(base.add(xo), xn) }.to_vec();
    let other = HostTensor::from_fn([4, 3], |i| 1.0 - i as f32 / 12.0).unwrap();
    let other_want = b.call(id, &[("x", &other)]).unwrap().remove(0).1;
    let bound = dlpack_from_host(other.clone()).unwrap();
    seen.run_with(sid, &[("x", &bound)]).unwrap();
    assert_eq!(seen.output(sid, "y").unwrap(), other_want, "computed from the bound tensor");
    assert_eq!(
        unsafe { std::slice::from_raw_parts(base.add(xo), xn) },
        before.as_slice(),
        "nothing copied in"
    );
    // Strided, wrong dtype, wrong shape, unknown name: refused.
    let ints = dlpack_from_host(HostTensor::from_i32([4, 3], vec![0; 12]).unwrap()).unwrap();
    let e = b.run_with(id, &[("x", &ints)]).unwrap_err().to_string();
    assert!(e.contains("expects f32") && e.contains("i32"), "{e}");
    let small = dlpack_from_host(HostTensor::zeros([2, 3]).unwrap()).unwrap();
    assert!(b.run_with(id, &[("x", &small)]).is_err());
    assert!(b.run_with(id, &[("nope", &input)]).is_err());
    let strided = unsafe { Dlpack::from_raw(strided_copy(&x())) }.unwrap();
    assert!(!strided.is_contiguous().unwrap());
    let e = b.run_with(id, &[("x", &strided)]).unwrap_err().to_string();
    assert!(e.contains("strided"), "{e}");
    assert!(host_from_dlpack(&strided).is_err());
    // A tensor that starts 4 bytes into an allocation (a slice like `x[1:]`) is not where a slot
    // could be: the kernels' 16-byte loads would fault on a GPU. Refused, named.
    let backing = vec![0.5f32; 16];
    let base = backing.as_ptr() as u64;
    let shifted = foreign(if base.is_multiple_of(16) { base + 4 } else { base }, dlpack::CPU, &[4, 3]);
    let e = b.run_with(id, &[("x", &shifted)]).unwrap_err().to_string();
    assert!(e.contains("16 bytes") && e.contains("`x`"), "{e}");
    drop(backing);
    // A plan that writes over its input in place refuses to bind it.
    let t = Tracer::new("in_place");
    let x_in = t.input("x", [4, 3]);
    t.output("y", &(x_in.exp() + 1.0));
    let mut c = CpuBackend::new(0);
    let plan = compile(t.finish().unwrap(), &CompileOptions::default()).unwrap();
    let writes = plan.steps.iter().any(|s| {
        s.output.is_some_and(|o| plan.values[o].buffer == plan.values[plan.input("x").unwrap().value].buffer)
    });
    let id = c.load(plan).unwrap();
    let r = c.run_with(id, &[("x", &input)]);
    if writes {
        assert!(r.unwrap_err().to_string().contains("writes over its input `x`"));
    } else {
        r.unwrap();
    }
}

/// A [4, 3] tensor laid out transposed ([3, 4] memory, strides (1, 4)): a strided DLPack tensor.
fn strided_copy(t: &HostTensor) -> *mut dlpack::DLManagedTensor {
    let mut data = vec![0f32; 12];
    for r in 0..4 {
        for c in 0..3 {
            data[c * 4 + r] = t.data()[r * 3 + c];
        }
    }
    let d = dlpack_from_host(HostTensor::new([4, 3], data).unwrap()).unwrap().into_raw();
    let strides = Box::leak(Box::new([1i64, 4]));
    unsafe { (*d).dl_tensor.strides = strides.as_mut_ptr() };
    d
}

#[test]
fn cuda_devices_export_in_place_and_import_by_copy() {
    for (name, device) in common::cuda_drivers() {
        eprintln!("on {name}");
        exports_in_place_and_imports_by_copy(device);
    }
}

fn exports_in_place_and_imports_by_copy(device: std::sync::Arc<dyn cuda::Driver>) {
    let mut gpu = CudaBackend::with_driver(device.clone(), 3, vec![], Tracker::default()).unwrap();
    let id = gpu.load(forward()).unwrap();
    let want = gpu.call(id, &[("x", &x())]).unwrap().remove(0).1;
    let y = gpu.output_dlpack(id, "y").unwrap();
    assert_eq!(y.device(), DLDevice { device_type: KDL_CUDA, device_id: 0 });
    assert!(
        host_from_dlpack(&y).unwrap_err().to_string().contains("not type 1"),
        "a device tensor is not read as a host one"
    );
    let w = gpu.variable_dlpack("w").unwrap();
    assert_eq!(w.shape().unwrap(), Shape::new([3, 2]));
    drop((y, w));
    // From a CPU tensor (host to device) and from a device tensor (on the device): same result.
    let host = dlpack_from_host(x()).unwrap();
    gpu.set_input_dlpack(id, "x", &host).unwrap();
    gpu.run(id).unwrap();
    assert_eq!(gpu.output(id, "y").unwrap(), want);
    let m = zoo::by_name("seed-mlp").unwrap();
    let train = compile(
        train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap(),
        &CompileOptions::default(),
    )
    .unwrap();
    let tid = gpu.load(train).unwrap();
    let (tx, ty) = m.batch_data(1).unwrap();
    gpu.call(tid, &[("x", &tx), ("y", &ty)]).unwrap();
    // The device tensor: the training step's own input slot, exported, then fed to another
    // plan's input of the same shape would need one; here the forward output feeds back as x
    // of a plan whose input has its shape.
    let t = Tracer::new("again");
    let xin = t.input("x", [4, 2]);
    t.output("z", &(&xin * 2.0));
    let again = gpu.load(compile(t.finish().unwrap(), &CompileOptions::default()).unwrap()).unwrap();
    gpu.call(id, &[("x", &x())]).unwrap();
    let y = gpu.output_dlpack(id, "y").unwrap();
    let y_raw = y.into_raw();
    let y = unsafe { Dlpack::from_raw(y_raw) }.unwrap();
    gpu.set_input_dlpack(again, "x", &y).unwrap();
    drop(y);
    gpu.run(again).unwrap();
    let z = gpu.output(again, "z").unwrap();
    assert_eq!(z.data(), want.data().iter().map(|v| v * 2.0).collect::<Vec<_>>().as_slice());

    // A tensor another library holds on the device, bound in place (no copy): the steps read it.
    let values: Vec<f32> = (0..8).map(|i| i as f32 - 3.0).collect();
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let ptr = device.alloc(bytes.len()).unwrap();
    unsafe { device.htod(ptr, &bytes).unwrap() };
    let theirs = foreign(ptr, DLDevice { device_type: KDL_CUDA, device_id: 0 }, &[4, 2]);
    gpu.run_with(again, &[("x", &theirs)]).unwrap();
    let z = gpu.output(again, "z").unwrap();
    assert_eq!(z.data(), values.iter().map(|v| v * 2.0).collect::<Vec<_>>().as_slice());
    // On the wrong device (the CPU) or of the wrong shape: refused.
    let host = dlpack_from_host(HostTensor::new([4, 2], values.clone()).unwrap()).unwrap();
    assert!(gpu.run_with(again, &[("x", &host)]).unwrap_err().to_string().contains("not type 2"));
    let wrong = foreign(ptr, DLDevice { device_type: KDL_CUDA, device_id: 0 }, &[2, 4]);
    assert!(gpu.run_with(again, &[("x", &wrong)]).is_err());
}

/// An f32 tensor another library holds at `ptr` on `device`, described as DLPack (no deleter:
/// the memory is the test's).
fn foreign(ptr: u64, device: DLDevice, dims: &[i64]) -> Dlpack<'static> {
    let shape: &'static mut [i64] = Box::leak(dims.to_vec().into_boxed_slice());
    let t = Box::new(dlpack::DLManagedTensor {
        dl_tensor: dlpack::DLTensor {
            data: ptr as *mut std::ffi::c_void,
            device,
            ndim: dims.len() as i32,
            dtype: dlpack::DLDataType { code: dlpack::KDL_FLOAT, bits: 32, lanes: 1 },
            shape: shape.as_mut_ptr(),
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: std::ptr::null_mut(),
        deleter: None,
    });
    unsafe { Dlpack::from_raw(Box::into_raw(t)) }.unwrap()
}

/// float16 and bfloat16 tensors another library holds (PyTorch's `torch.bfloat16`) come in as
/// f32 host tensors, widened exactly; kiln's dtypes map to DLPack's and back.
#[test]
fn half_tensors_import_widened_to_f32() {
    for (dtype, code) in [(DType::F16, dlpack::KDL_FLOAT), (DType::BF16, dlpack::KDL_BFLOAT)] {
        let dl = dlpack::dl_dtype(dtype).unwrap();
        assert_eq!((dl.code, dl.bits, dl.lanes), (code, 16, 1));
        assert_eq!(dlpack::kiln_dtype(dl).unwrap(), dtype);
        let values = [1.5f32, -0.25, 65504.0, 3.0e-3];
        let mut bits: Vec<u16> = values
            .iter()
            .map(|&v| {
                if dtype == DType::F16 {
                    half::f16::from_f32(v).to_bits()
                } else {
                    half::bf16::from_f32(v).to_bits()
                }
            })
            .collect();
        let shape: &'static mut [i64] = Box::leak(vec![2i64, 2].into_boxed_slice());
        let t = Box::new(dlpack::DLManagedTensor {
            dl_tensor: dlpack::DLTensor {
                data: bits.as_mut_ptr() as *mut std::ffi::c_void,
                device: CPU,
                ndim: 2,
                dtype: dl,
                shape: shape.as_mut_ptr(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: None,
        });
        let t = unsafe { Dlpack::from_raw(Box::into_raw(t)) }.unwrap();
        let host = host_from_dlpack(&t).unwrap();
        assert_eq!(host.dtype(), DType::F32);
        let want: Vec<f32> = bits
            .iter()
            .map(|&b| {
                if dtype == DType::F16 {
                    half::f16::from_bits(b).to_f32()
                } else {
                    half::bf16::from_bits(b).to_f32()
                }
            })
            .collect();
        assert_eq!(host.data(), want.as_slice(), "{dtype}");
    }
}
