//! Memory you own (`kiln::runtime::owned_memory`): a plan's arena placed in the caller's region,
//! its inputs written and outputs read there in place (nothing copied in or out), on the CPU and
//! on the CUDA backend (the emulated device, and the GPU where there is one); a region too small or misaligned, or a plan over two devices, is
//! refused before anything is loaded.

mod common;

use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::runtime::cuda::{CudaBackend, Driver};
use kiln::runtime::memory::Tracker;
use kiln::runtime::owned_memory::io_offset;
use kiln::zoo;

fn plan() -> Plan {
    let m = zoo::by_name("seed-mlp").unwrap();
    compile(
        train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap(),
        &CompileOptions::default(),
    )
    .unwrap()
}

/// A leaked region of `len` bytes starting `skew` bytes after a 4 KiB boundary.
fn region(len: usize, skew: usize) -> &'static mut [u8] {
    let raw: &'static mut [u8] = Box::leak(vec![0u8; len + 4096 + skew].into_boxed_slice());
    let start = (4096 - (raw.as_ptr() as usize % 4096)) % 4096 + skew;
    &mut raw[start..start + len]
}

fn le(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn a_plan_runs_in_the_callers_host_memory_with_nothing_copied() {
    let m = zoo::by_name("seed-mlp").unwrap();
    let (x, y) = m.batch_data(3).unwrap();
    let mut reference = CpuBackend::new(5);
    let id = reference.load(plan()).unwrap();
    let want: Vec<Vec<f32>> = (0..3)
        .map(|_| {
            reference
                .call(id, &[("x", &x), ("y", &y)])
                .unwrap()
                .into_iter()
                .find(|o| o.0 == "loss")
                .unwrap()
                .1
                .into_data()
        })
        .collect();

    let p = plan();
    let (xo, xn) = io_offset(&p, "x").unwrap();
    let (yo, yn) = io_offset(&p, "y").unwrap();
    let (lo, ln) = io_offset(&p, "loss").unwrap();
    let bytes = p.memory.arena_bytes;
    let mine = region(bytes, 0);
    let base = mine.as_mut_ptr();
    let mut b = CpuBackend::new(5);
    let id = b.load_into(p, mine).unwrap();
    for step in &want {
        // SAFETY (test): the region is ours and the backend does not run while we write it.
        let arena = unsafe { std::slice::from_raw_parts_mut(base, bytes) };
        arena[xo..xo + xn].copy_from_slice(&le(x.data()));
        arena[yo..yo + yn].copy_from_slice(&le(y.data()));
        b.set_input_in_place(id, "x").unwrap();
        b.set_input_in_place(id, "y").unwrap();
        b.run(id).unwrap();
        let arena = unsafe { std::slice::from_raw_parts(base, bytes) };
        let loss = f32::from_le_bytes(arena[lo..lo + ln][..4].try_into().unwrap());
        assert_eq!(loss.to_bits(), step[0].to_bits(), "same bits as the backend's own arena");
    }
    // An input not written in place is still missing: runs need every input each time.
    assert!(b.run(id).is_err());

    // Refused before anything is loaded.
    let mut c = CpuBackend::new(5);
    let e = c.load_into(plan(), region(bytes - 1, 0)).unwrap_err().to_string();
    assert!(e.contains(&format!("needs {bytes}")), "{e}");
    let e = c.load_into(plan(), region(bytes, 4)).unwrap_err().to_string();
    assert!(e.contains("not aligned"), "{e}");
    assert!(c.plan(0).is_err(), "nothing half-loaded");
    let normal = c.load(plan()).unwrap();
    let e = c.set_input_in_place(normal, "x").unwrap_err().to_string();
    assert!(e.contains("copied in"), "{e}");
    assert!(io_offset(&plan(), "nope").is_err());
}

#[test]
fn a_plan_runs_in_the_callers_device_memory_on_every_cuda_device() {
    for (name, device) in common::cuda_drivers() {
        eprintln!("on {name}");
        runs_in_the_callers_device_memory(device);
    }
}

fn runs_in_the_callers_device_memory(device: std::sync::Arc<dyn Driver>) {
    let m = zoo::by_name("seed-mlp").unwrap();
    let (x, y) = m.batch_data(3).unwrap();
    let mut cpu = CpuBackend::new(5);
    let id = cpu.load(plan()).unwrap();
    let want = cpu.call(id, &[("x", &x), ("y", &y)]).unwrap().into_iter().find(|o| o.0 == "loss").unwrap().1;

    let p = plan();
    let (xo, _) = io_offset(&p, "x").unwrap();
    let (yo, _) = io_offset(&p, "y").unwrap();
    let (lo, _) = io_offset(&p, "loss").unwrap();
    let bytes = p.memory.arena_bytes;
    let ptr = device.alloc(bytes).unwrap();
    let mut gpu = CudaBackend::with_driver(device.clone(), 5, vec![], Tracker::default()).unwrap();
    // SAFETY (test): `ptr` is this device's allocation of `bytes`, kept until the end.
    let id = unsafe { gpu.load_into(p, ptr, bytes) }.unwrap();
    unsafe {
        device.htod(ptr + xo as u64, &le(x.data())).unwrap();
        device.htod(ptr + yo as u64, &le(y.data())).unwrap();
    }
    gpu.set_input_in_place(id, "x").unwrap();
    gpu.set_input_in_place(id, "y").unwrap();
    gpu.run(id).unwrap();
    let mut out = [0u8; 4];
    unsafe { device.dtoh(ptr + lo as u64, &mut out).unwrap() };
    let loss = f32::from_le_bytes(out);
    assert!(
        (loss - want.data()[0]).abs() <= 2e-4 * want.data()[0].abs().max(1.0),
        "{loss} vs {}",
        want.data()[0]
    );
    // A misaligned address is refused before loading.
    let e = unsafe { gpu.load_into(plan(), ptr + 4, bytes) }.unwrap_err().to_string();
    assert!(e.contains("not aligned"), "{e}");
}
