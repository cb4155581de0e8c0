//! Devices and memory policies: configuration mistakes, logical devices, limits checked at
//! compile time, growth and preallocation, placement (by scope and automatic), and statistics.

mod common;

use kiln::compiler::ir::DeviceId;
use kiln::compiler::placement::{Placed, split_sequential};
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::runtime::devices::{DeviceConfig, GB, MB};
use kiln::zoo;

fn seed_batch() -> (HostTensor, HostTensor) {
    zoo::by_name("seed-mlp").unwrap().batch_data(4).unwrap()
}

#[test]
fn configuration_mistakes_are_reported_together() {
    let e = DeviceConfig::cpu(8 * GB)
        .set_memory_limit("gpu:7", 100 * MB)
        .set_memory_fraction("cpu:0", 1.5)
        .set_logical_devices("cpu:0", &[6 * GB, 4 * GB])
        .build()
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("3 mistake(s)"), "{e}");
    assert!(e.contains("no physical device `gpu:7`"), "{e}");
    assert!(e.contains("must be in (0, 1]"), "{e}");
    assert!(e.contains("add up to 10.00 GiB, more than the 8.00 GiB available"), "{e}");
    let e = DeviceConfig::cpu(GB).set_memory_growth("cpu:0", true).set_memory_fraction("cpu:0", 0.5).build();
    assert!(e.err().unwrap().to_string().contains("exclude each other"));
    let e = DeviceConfig::cpu(GB).set_memory_limit("cpu:0", 2 * GB).build();
    assert!(e.err().unwrap().to_string().contains("exceeds the device's 1.00 GiB"));
}

#[test]
fn logical_devices_split_a_physical_device() {
    let devices =
        DeviceConfig::cpu(8 * GB).set_logical_devices("cpu:0", &[GB, 4 * GB, 2 * GB]).build().unwrap();
    let names: Vec<&str> = devices.logical().iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["cpu:0", "cpu:1", "cpu:2"]);
    let limits: Vec<Option<usize>> = devices.logical().iter().map(|d| d.budget.limit).collect();
    assert_eq!(limits, [Some(GB), Some(4 * GB), Some(2 * GB)]);
    assert!(devices.logical().iter().all(|d| d.physical == "cpu:0"));
    let table = devices.table();
    assert!(table.contains("cpu:2") && table.contains("2.00 GiB"), "{table}");
}

#[test]
fn a_plan_over_the_limit_fails_at_compile_time_with_a_report() {
    let devices = DeviceConfig::cpu(GB).set_logical_devices("cpu:0", &[16 * 1024, 256 * MB]).build().unwrap();
    let options = devices.compile_options(&["cpu:0"]).unwrap();
    let mut trainer =
        Trainer::new(zoo::seed_mlp(), zoo::seed_config(), devices.backend(&["cpu:0"], 0).unwrap())
            .with_options(options);
    let (x, y) = seed_batch();
    let e = trainer.train_step(&x, &y).unwrap_err().to_string();
    assert!(e.starts_with("out of memory on device cpu:0"), "{e}");
    assert!(
        e.contains("limit is 16.00 KiB") && e.contains("lower bound") && e.contains("largest tensors"),
        "{e}"
    );
    assert!(e.contains("help:"), "{e}");
    assert_eq!(devices.memory_info("cpu:0").unwrap().planned.current, 0, "nothing was allocated");
}

#[test]
fn out_of_memory_report() {
    let m = zoo::by_name("mlp").unwrap();
    let g = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let e = compile(g, &CompileOptions::device("gpu:0", Some(20 * MB))).unwrap_err();
    insta::assert_snapshot!(e.to_string());
}

#[test]
fn growth_takes_a_plans_memory_at_load_in_one_allocation_exactly() {
    let devices = DeviceConfig::cpu(GB).set_memory_growth("cpu:0", true).build().unwrap();
    let mut trainer =
        Trainer::new(zoo::seed_mlp(), zoo::seed_config(), devices.backend(&["cpu:0"], 0).unwrap())
            .with_options(devices.compile_options(&["cpu:0"]).unwrap());
    let (x, y) = seed_batch();
    let id = trainer.train_program(x.shape(), y.shape()).unwrap();
    let loaded = devices.memory_info("cpu:0").unwrap().planned;
    let plan = trainer.backend().plan(id).unwrap();
    let m = &plan.memory;
    // Inputs and outputs live in the arena: no io region.
    assert!(loaded.io == 0);
    // One block: the variable region, then the arena (`plan::device_block`), each counted up to
    // where the next begins.
    let (offsets, block) = kiln::compiler::plan::device_block(
        [m.variable_region_bytes, m.io_bytes, m.arena_bytes],
        plan.block_align(),
    )
    .unwrap();
    assert_eq!(offsets[2], m.variable_region_bytes.next_multiple_of(256));
    assert_eq!(loaded.variables, offsets[2], "the variable region, exactly (aligned)");
    assert_eq!(loaded.arenas, m.arena_bytes.div_ceil(256) * 256, "the arena, exactly (aligned)");
    assert_eq!(loaded.reserved, block, "what the device reserved is the one block");
    assert_eq!(plan.device_bytes(2 << 20), 2 << 20, "the seed model's step takes one 2 MiB granule");
    trainer.train_step(&x, &y).unwrap();
    let ran = devices.memory_info("cpu:0").unwrap().planned;
    assert_eq!(ran, loaded, "steps allocate nothing");
    trainer.train_step(&x, &y).unwrap();
    assert_eq!(devices.memory_info("cpu:0").unwrap().planned, ran, "later steps allocate nothing");
}

#[test]
fn preallocation_carves_everything_from_one_region() {
    let devices = DeviceConfig::cpu(GB)
        .set_memory_limit("cpu:0", 64 * MB)
        .set_memory_fraction("cpu:0", 0.5)
        .build()
        .unwrap();
    let mut trainer =
        Trainer::new(zoo::seed_mlp(), zoo::seed_config(), devices.backend(&["cpu:0"], 0).unwrap())
            .with_options(devices.compile_options(&["cpu:0"]).unwrap());
    let info = devices.memory_info("cpu:0").unwrap().planned;
    assert_eq!(info.reserved, 32 * MB, "half of the 64 MiB limit is taken up front");
    let (x, y) = seed_batch();
    trainer.train_step(&x, &y).unwrap();
    let info = devices.memory_info("cpu:0").unwrap().planned;
    assert_eq!(info.reserved, 32 * MB, "nothing beyond the region");
    assert!(info.arenas > 0 && info.current <= 32 * MB);
    // The plan limit is the preallocated region: a model that needs more does not compile.
    assert_eq!(devices.compile_options(&["cpu:0"]).unwrap().devices[0].memory_limit, Some(32 * MB));
}

/// Runs two training steps of the seed model on `names` (layer 0 on the first device, layer 1 on
/// the last) and returns the losses.
fn placed_losses(devices: &kiln::runtime::devices::Devices, names: &[&str]) -> (Vec<f32>, Plan) {
    let ranges = vec![(DeviceId(0), 0..1), (DeviceId(names.len() as u32 - 1), 1..2)];
    let model = Placed::new(zoo::seed_mlp(), ranges);
    let mut trainer = Trainer::new(model, zoo::seed_config(), devices.backend(names, 3).unwrap())
        .with_options(devices.compile_options(names).unwrap());
    let (x, y) = seed_batch();
    let losses = (0..2).map(|_| trainer.train_step(&x, &y).unwrap().loss).collect();
    (losses, trainer.plans()[0].clone())
}

#[test]
fn ops_placed_on_two_devices_compute_what_one_device_computes() {
    let devices = DeviceConfig::cpu(GB).set_logical_devices("cpu:0", &[64 * MB, 64 * MB]).build().unwrap();
    let (one, single) = placed_losses(&devices, &["cpu:0"]);
    let (two, split) = placed_losses(&devices, &["cpu:0", "cpu:1"]);
    assert_eq!(single.devices.len(), 1);
    assert_eq!(split.devices.len(), 2);
    for (a, b) in one.iter().zip(&two) {
        assert!((a - b).abs() <= 1e-6, "{one:?} vs {two:?}");
    }
    let copies = split.steps.iter().filter(|s| s.op.name() == "copy").count();
    assert!(copies >= 2, "activations go forward and gradients back: {copies} copies");
    assert!(split.devices.iter().all(|d| d.memory.arena_bytes > 0));
    for d in ["cpu:0", "cpu:1"] {
        assert!(devices.memory_info(d).unwrap().planned.variables > 0, "{d} holds its layer's parameters");
    }
}

#[test]
fn an_op_on_an_unconfigured_device_is_an_error() {
    let t = Tracer::new("bad");
    let x = t.input("x", [2, 2]);
    let y = t.on_device(DeviceId(3), || x.relu());
    t.output("y", &y);
    let e = compile(t.finish().unwrap(), &CompileOptions::default()).unwrap_err().to_string();
    assert!(
        e.contains("placed on device 3, which is not configured") && e.contains("tests/devices.rs"),
        "{e}"
    );
}

#[test]
fn a_sequential_model_is_split_over_devices_of_different_sizes() {
    // The seed's 1 GB / 4 GB / 2 GB case, scaled to MiB so that it trains here for real.
    let devices = DeviceConfig::cpu(GB).set_logical_devices("cpu:0", &[MB, 4 * MB, 2 * MB]).build().unwrap();
    let names = ["cpu:0", "cpu:1", "cpu:2"];
    let model = || {
        let mut m = Sequential::new();
        for _ in 0..20 {
            m.push(Dense::new(128).relu());
        }
        m.push(Dense::new(1).sigmoid());
        m
    };
    let (x, y) = (
        HostTensor::from_fn([64, 128], |i| (i % 7) as f32 / 7.0).unwrap(),
        HostTensor::from_fn([64, 1], |i| (i % 2) as f32).unwrap(),
    );
    let options = devices.compile_options(&names).unwrap();
    let whole = compile(
        train_step_graph(&model(), x.shape(), y.shape(), &zoo::seed_config()).unwrap(),
        &CompileOptions::default(),
    )
    .unwrap();
    assert!(whole.memory.planned_total_bytes() > 4 * MB, "the model fits no single device");
    let split =
        split_sequential(&model(), x.shape(), y.shape(), &zoo::seed_config(), &options.devices, 256).unwrap();
    eprintln!("{}", split.describe());
    assert!(split.ranges.len() >= 2);
    for d in &split.plan.devices {
        assert!(d.memory.persistent_bytes + d.memory.arena_bytes <= d.memory_limit.unwrap(), "{}", d.name);
    }
    let covered: usize = split.ranges.iter().map(|r| r.1.len()).sum();
    assert_eq!(covered, 21);
    // It trains on the split, with the same losses as on one unlimited device.
    let mut split_trainer = Trainer::new(
        Placed::new(model(), split.placement.clone()),
        zoo::seed_config(),
        devices.backend(&names, 9).unwrap(),
    )
    .with_options(options);
    let mut one = Trainer::new(model(), zoo::seed_config(), Device::cpu().backend(9).unwrap());
    for _ in 0..2 {
        let (a, b) = (split_trainer.train_step(&x, &y).unwrap().loss, one.train_step(&x, &y).unwrap().loss);
        assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
    }
}

#[test]
fn memory_stats_report_current_and_peak_and_reset() {
    let devices = DeviceConfig::cpu(GB).build().unwrap();
    let mut trainer =
        Trainer::new(zoo::seed_mlp(), zoo::seed_config(), devices.backend(&["cpu:0"], 0).unwrap())
            .with_options(devices.compile_options(&["cpu:0"]).unwrap());
    let (x, y) = seed_batch();
    trainer.train_step(&x, &y).unwrap();
    let info = devices.memory_info("cpu:0").unwrap();
    assert_eq!(info.planned.current, info.planned.arenas + info.planned.io + info.planned.variables);
    assert_eq!(info.planned.peak, info.planned.current);
    assert!(info.driver.is_none());
    devices.reset_memory_stats("cpu:0").unwrap();
    assert_eq!(devices.memory_info("cpu:0").unwrap().planned.peak, info.planned.current);
    assert!(devices.memory_info("gpu:5").is_err());
}

#[test]
fn gpu_logical_devices_hold_their_plans_and_limits() {
    let config = DeviceConfig::detect();
    if !config.has_gpu() {
        if std::env::var("KILN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
            panic!("KILN_REQUIRE_GPU=1 but no CUDA device: {}", Device::best().1);
        }
        eprintln!("skipped: no CUDA device");
        return;
    }
    let devices = config.set_logical_devices("gpu:0", &[64 * MB, 64 * MB]).build().unwrap();
    let (one, _) = placed_losses(&devices, &["gpu:0"]);
    let (two, plan) = placed_losses(&devices, &["gpu:0", "gpu:1"]);
    assert_eq!(plan.devices.len(), 2);
    for (a, b) in one.iter().zip(&two) {
        assert!((a - b).abs() <= 1e-5, "{one:?} vs {two:?}");
    }
    let info = devices.memory_info("gpu:1").unwrap();
    assert!(info.planned.arenas > 0 && info.driver.is_some());
    let options = devices.compile_options(&["gpu:0"]).unwrap();
    let m = zoo::by_name("cnn").unwrap().with_batch(512);
    let e = compile(kiln::compare::graph_of(&m, kiln::compare::Mode::Train).unwrap(), &options).unwrap_err();
    assert!(e.to_string().starts_with("out of memory on device gpu:0"));
}
