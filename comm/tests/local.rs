//! The in-process engine: results bit for bit against serial rank-order sums on 1–4 ranks, the
//! mistakes every rank must report alike, and peers that leave or stall.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::{check_collectives, check_mistakes, input, is_peer_left, serial_sum};
use kiln_comm::{CommError, Communicator, LocalComm, local_group, local_group_with_timeout};

/// Runs `f` on every rank of `comms`, one thread each; returns the results in rank order.
fn on_threads<T: Send>(comms: Vec<LocalComm>, f: impl Fn(LocalComm) -> T + Sync) -> Vec<T> {
    thread::scope(|s| {
        let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    })
}

fn assert_all_passed(size: usize, outcomes: Vec<Vec<common::Outcome>>) {
    for (rank, checks) in outcomes.into_iter().enumerate() {
        for (name, res) in checks {
            if let Err(e) = res {
                panic!("{size} ranks, rank {rank}, {name}: {e}");
            }
        }
    }
}

#[test]
fn collectives_equal_a_serial_rank_order_sum_bit_for_bit() {
    for size in 1..=4 {
        let outcomes = on_threads(local_group(size), |mut c| check_collectives(&mut c));
        assert_all_passed(size, outcomes);
    }
}

#[test]
fn all_reduce_results_are_identical_across_ranks() {
    for size in 1..=4 {
        let sums = on_threads(local_group(size), |mut c| {
            let mut buf = input(c.rank(), 1000);
            c.all_reduce_sum(&mut buf).unwrap();
            buf.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        });
        assert!(sums.iter().all(|s| *s == sums[0]), "{size} ranks: the sums differ between ranks");
    }
}

/// Ranks reuse their stage buffers every other round: back-to-back calls with fresh data each
/// time must never read a peer's stale or next data.
#[test]
fn back_to_back_calls_see_each_others_current_data() {
    let size = 3;
    let outcomes = on_threads(local_group(size), |mut c| {
        let rank = c.rank();
        for step in 0..300 {
            let len = 5 + step % 4;
            let value = |r: usize| (step * 10 + r) as f32;
            let range = kiln_comm::shard_range(len, rank, size);
            let mut out = vec![f32::NAN; len];
            c.all_gather(&vec![value(rank); range.len()], &mut out).unwrap();
            let want: Vec<f32> =
                (0..size).flat_map(|r| vec![value(r); kiln_comm::shard_range(len, r, size).len()]).collect();
            assert_eq!(out, want, "all_gather, step {step}");
            let mut buf = vec![value(rank); len];
            c.broadcast(&mut buf, step % size).unwrap();
            assert_eq!(buf, vec![value(step % size); len], "broadcast, step {step}");
            let mut shard = vec![f32::NAN; range.len()];
            c.reduce_scatter_sum(&vec![value(rank); len], &mut shard).unwrap();
            let sum = value(0) + value(1) + value(2);
            assert_eq!(shard, vec![sum; range.len()], "reduce_scatter_sum, step {step}");
            let mut buf = vec![value(rank); len];
            c.all_reduce_sum(&mut buf).unwrap();
            assert_eq!(buf, vec![sum; len], "all_reduce_sum, step {step}");
        }
    });
    assert_eq!(outcomes.len(), size);
}

/// The data must be able to tell the orders apart, or the bit-for-bit checks prove nothing.
#[test]
fn the_test_data_is_order_sensitive() {
    for size in 3..=4 {
        let forward = serial_sum(1000, size);
        let mut backward = input(size - 1, 1000);
        for r in (0..size - 1).rev() {
            for (s, x) in backward.iter_mut().zip(input(r, 1000)) {
                *s += x;
            }
        }
        let differ = forward.iter().zip(&backward).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert!(differ > 0, "{size} ranks: reversed order gives the same bits everywhere");
    }
}

#[test]
fn mistakes_are_the_same_error_on_every_rank() {
    for size in 1..=4 {
        let outcomes = on_threads(local_group(size), |mut c| check_mistakes(&mut c));
        assert_all_passed(size, outcomes);
    }
}

#[test]
fn agree_names_the_ranks_that_differ() {
    let errors = on_threads(local_group(3), |mut c| {
        let fp: &[u8] = if c.rank() == 1 { b"plan-b" } else { b"plan-a" };
        c.agree("plan", fp).unwrap_err()
    });
    for err in &errors {
        let CommError::Disagree { what, groups, .. } = err else { panic!("not a disagreement: {err}") };
        assert_eq!(what, "plan");
        assert_eq!(groups, &vec![vec![0, 2], vec![1]]);
        let msg = err.to_string();
        assert!(msg.contains("ranks 0, 2 hold 706c616e2d61"), "{msg}");
        assert!(msg.contains("rank 1 holds 706c616e2d62"), "{msg}");
    }
    assert!(errors.iter().all(|e| *e == errors[0]), "the ranks report different errors");
}

#[test]
fn wrong_lengths_are_errors_naming_the_call_and_both_lengths() {
    let errors = on_threads(local_group(2), |mut c| {
        let mut buf = vec![0.0; 4 + c.rank()];
        c.all_reduce_sum(&mut buf).unwrap_err()
    });
    for err in errors {
        assert!(matches!(err, CommError::LengthMismatch { len: 4, other_len: 5, .. }), "{err}");
        assert!(err.to_string().starts_with("all_reduce_sum: rank 0 passed 4 elements but rank 1 passed 5"));
    }
    let errors = on_threads(local_group(3), |mut c| {
        let mut shard = vec![0.0; 2];
        c.reduce_scatter_sum(&[1.0; 7], &mut shard).unwrap_err()
    });
    for err in errors {
        assert!(
            matches!(err, CommError::ShardLength { rank: 0, len: 2, expected: 3, total: 7, size: 3, .. }),
            "{err}"
        );
    }
}

#[test]
fn a_dropped_peer_is_an_error_at_once() {
    let timeout = Duration::from_secs(20);
    let results = on_threads(local_group_with_timeout(3, timeout), |mut c| {
        if c.rank() == 2 {
            return None; // drops its communicator without joining
        }
        let start = Instant::now();
        let err = c.all_reduce_sum(&mut [1.0; 10]).unwrap_err();
        Some((err, start.elapsed()))
    });
    for (err, waited) in results.into_iter().flatten() {
        // The first rank to notice gets `PeerLeft`; a rank arriving after that finds the group
        // broken, and the error names the cause.
        assert!(matches!(err, CommError::PeerLeft { rank: 2, .. } | CommError::Broken { .. }), "{err}");
        assert!(err.to_string().contains("rank 2 left the group"), "{err}");
        assert!(waited < Duration::from_secs(5), "noticed after {waited:?}");
    }
}

#[test]
fn a_panicking_peer_is_an_error_not_a_hang() {
    let mut comms = local_group_with_timeout(3, Duration::from_secs(20));
    let doomed = comms.pop().unwrap();
    let panicker = thread::spawn(move || {
        let _comm = doomed;
        thread::sleep(Duration::from_millis(50));
        panic!("rank 2 fails on purpose");
    });
    let errors = on_threads(comms, |mut c| {
        c.barrier().expect_err("rank 2 never joins");
        let err = c.all_reduce_sum(&mut [1.0; 3]).unwrap_err();
        (c.rank(), err)
    });
    assert!(panicker.join().is_err());
    for (rank, err) in errors {
        // The barrier already broke the group: later calls say so and name the cause.
        assert!(matches!(err, CommError::Broken { .. }), "rank {rank}: {err}");
        assert!(err.to_string().contains("rank 2 left the group"), "rank {rank}: {err}");
    }
}

#[test]
fn a_stalled_peer_is_a_timeout() {
    let timeout = Duration::from_millis(200);
    let results = on_threads(local_group_with_timeout(3, timeout), |mut c| {
        if c.rank() == 2 {
            thread::sleep(Duration::from_millis(1500));
            return (c.barrier().unwrap_err(), Duration::ZERO);
        }
        let start = Instant::now();
        let err = c.all_reduce_sum(&mut [1.0; 10]).unwrap_err();
        (err, start.elapsed())
    });
    for (rank, (err, waited)) in results.into_iter().enumerate() {
        if rank == 2 {
            assert!(matches!(err, CommError::Broken { .. }), "{err}");
            continue;
        }
        assert!(matches!(&err, CommError::Timeout { missing, .. } if *missing == vec![2]), "{err}");
        assert!(waited < timeout + Duration::from_secs(2), "gave up after {waited:?}");
    }
}

#[test]
fn the_group_fails_fast_after_a_peer_left() {
    let mut comms = local_group(2);
    drop(comms.pop());
    let mut c = comms.pop().unwrap();
    let start = Instant::now();
    let err = c.broadcast(&mut [0.0], 0).unwrap_err();
    assert!(is_peer_left(&err, 1), "{err}");
    assert!(start.elapsed() < Duration::from_secs(1));
    let err = c.barrier().unwrap_err();
    assert!(matches!(err, CommError::Broken { .. }), "{err}");
}

#[test]
fn the_default_timeout_is_set() {
    let comms = local_group(1);
    assert_eq!(comms[0].timeout(), kiln_comm::DEFAULT_TIMEOUT);
    let mut c = local_group(1).pop().unwrap();
    c.set_timeout(Duration::from_secs(1));
    assert_eq!(c.timeout(), Duration::from_secs(1));
}
