//! Hand-made placement cases: each checks an exact layout that best fit must find.

use kiln_compiler::planner::timeline::Timeline;
use kiln_compiler::planner::workloads::{OpTrace, chain};
use kiln_compiler::planner::{
    Bound, Heuristic, Interval, PARALLEL_MIN, Placement, align, best_fit, lower_bound, naive_bytes, place,
    verify,
};

fn iv(bytes: usize, start: usize, end: usize) -> Interval {
    Interval::new(bytes, start, end)
}

/// Places, verifies and checks the figures every placement must satisfy.
fn plan(intervals: &[Interval], alignment: usize) -> Placement {
    let p = place(intervals, alignment);
    verify(intervals, &p, alignment).unwrap();
    let tight =
        intervals.iter().zip(&p.offsets).map(|(iv, o)| o + align(iv.bytes, alignment)).max().unwrap_or(0);
    assert_eq!(p.arena_bytes, tight);
    assert!(p.arena_bytes >= lower_bound(intervals, alignment).bytes);
    assert!(p.arena_bytes <= naive_bytes(intervals, alignment));
    p
}

#[test]
fn a_chain_alternates_between_two_slots() {
    let ivs = chain(10, 1000);
    let p = plan(&ivs, 256);
    assert_eq!(p.arena_bytes, 2048);
    assert_eq!(lower_bound(&ivs, 256), Bound { bytes: 2048, step: 1 });
    let slots: Vec<usize> = p.offsets.iter().map(|o| o / 1024).collect();
    assert_eq!(slots, [0, 1, 0, 1, 0, 1, 0, 1, 0, 1]);
}

#[test]
fn output_and_input_of_one_op_do_not_share_bytes() {
    // The output starts at the step where the input dies: they conflict (in-place reuse is the
    // compiler's decision, made before planning).
    let ivs = [iv(512, 0, 3), iv(512, 3, 5)];
    let p = plan(&ivs, 256);
    assert_eq!(p.arena_bytes, 1024);
    assert_ne!(p.offsets[0], p.offsets[1]);
    // One step later they can share.
    let p = plan(&[iv(512, 0, 3), iv(512, 4, 5)], 256);
    assert_eq!((p.arena_bytes, p.offsets.as_slice()), (512, &[0, 0][..]));
}

#[test]
fn short_buffers_reuse_the_space_beside_a_long_one() {
    // A long-lived 4 KiB buffer (an activation saved for backward) and a chain of 1 KiB temporaries
    // around it: the temporaries alternate between two slots above the long one.
    let mut ivs = vec![iv(4096, 0, 20)];
    ivs.extend((0..20).map(|i| iv(1024, i, i + 1)));
    let p = plan(&ivs, 256);
    assert_eq!(p.arena_bytes, 4096 + 2048);
    assert_eq!(p.arena_bytes, lower_bound(&ivs, 256).bytes);
    assert_eq!(p.offsets[0], 0);
    assert!(p.offsets[1..].iter().all(|&o| o == 4096 || o == 5120), "{:?}", p.offsets);
}

#[test]
fn buffers_nested_like_a_training_step_stack_without_waste() {
    // Forward activations a0..a3, each freed in reverse order by the backward pass.
    let mut t = OpTrace::new();
    let acts: Vec<_> = (0..4).map(|k| t.op1(&[], 1000 * (k + 1))).collect();
    for a in acts.iter().rev() {
        t.op(&[*a], &[]);
    }
    let ivs = t.intervals();
    let p = plan(&ivs, 1);
    assert_eq!(p.arena_bytes, 10_000);
}

#[test]
fn best_fit_takes_the_smallest_gap_that_fits() {
    // Placed in input order, everything live at step 0 stacks up: 1 KiB walls live at steps 0..=9
    // at 0, 3, 5 and 8 KiB, with short buffers between them that die at step 0. From step 1 on the
    // gaps are 2 KiB at 1 KiB, 1 KiB at 4 KiB and 2 KiB at 6 KiB: the 1 KiB filler takes the exact
    // gap, not the first one it fits in.
    let ivs = [
        iv(1024, 0, 9), // wall at 0
        iv(2048, 0, 0),
        iv(1024, 0, 9), // wall at 3 KiB
        iv(1024, 0, 0),
        iv(1024, 0, 9), // wall at 5 KiB
        iv(2048, 0, 0),
        iv(1024, 0, 9), // wall at 8 KiB
        iv(1024, 5, 6), // the filler
    ];
    let t = Timeline::new(&ivs, 1024);
    let fit = best_fit::place_in_order(&t, &[0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(fit.offsets, vec![0, 1024, 3072, 4096, 5120, 6144, 8192, 4096]);
    assert_eq!(fit.arena_bytes, 9216);
}

#[test]
fn when_no_gap_fits_it_goes_on_top_of_the_highest_conflict() {
    let ivs = [iv(1024, 0, 9), iv(512, 0, 0), iv(512, 0, 9), iv(2048, 5, 5)];
    let t = Timeline::new(&ivs, 512);
    let fit = best_fit::place_in_order(&t, &[0, 1, 2, 3]);
    // 0 at [0, 1024), 1 at [1024, 1536), 2 at [1536, 2048); at step 5 the gap [1024, 1536) is
    // too small for 2 KiB, so it goes on top.
    assert_eq!(fit.offsets, vec![0, 1024, 1536, 2048]);
}

#[test]
fn zero_sized_buffers_take_nothing() {
    let ivs = [iv(0, 0, 9), iv(300, 0, 5), iv(0, 3, 3), iv(300, 6, 9)];
    let p = plan(&ivs, 256);
    assert_eq!(p.arena_bytes, 512);
    assert_eq!((p.offsets[0], p.offsets[2]), (0, 0));
    let only_zero = [iv(0, 0, 1), iv(0, 1, 2)];
    let p = plan(&only_zero, 256);
    assert_eq!(p.arena_bytes, 0);
    assert_eq!(naive_bytes(&only_zero, 256), 0);
}

#[test]
fn sizes_and_offsets_follow_the_alignment() {
    let ivs = [iv(1, 0, 2), iv(257, 1, 3), iv(100, 2, 2)];
    let p = plan(&ivs, 256);
    assert!(p.offsets.iter().all(|o| o % 256 == 0));
    assert_eq!(p.arena_bytes, 256 + 512 + 256);
    let p = plan(&ivs, 1);
    assert_eq!(p.arena_bytes, 1 + 257 + 100);
    assert_eq!(align(0, 256), 0);
    assert_eq!(align(256, 256), 256);
    assert_eq!(align(257, 256), 512);
    assert_eq!(align(5, 3), 6);
}

#[test]
fn empty_input() {
    let p = plan(&[], 256);
    assert_eq!(p.arena_bytes, 0);
    assert!(p.offsets.is_empty());
    assert_eq!(p.tried.len(), Heuristic::ALL.len());
    assert_eq!(lower_bound(&[], 256), Bound { bytes: 0, step: 0 });
}

#[test]
fn reports_every_heuristic_and_keeps_the_smallest() {
    let ivs = kiln_compiler::planner::workloads::random_mix(500, 100, 3);
    let p = plan(&ivs, 256);
    let names: Vec<&str> = p.tried.iter().map(|(n, _)| n.as_str()).collect();
    let all: Vec<&str> = Heuristic::ALL.iter().map(|h| h.name()).collect();
    assert_eq!(names, all);
    let min = p.tried.iter().map(|(_, a)| *a).min().unwrap();
    assert_eq!(p.arena_bytes, min);
    // The first heuristic with the smallest arena wins.
    let first = p.tried.iter().find(|(_, a)| *a == min).unwrap();
    assert_eq!(p.algorithm, first.0);
}

#[test]
fn parallel_and_sequential_runs_agree() {
    // Above PARALLEL_MIN the heuristics run on threads; each must equal its lone sequential run.
    let ivs = kiln_compiler::planner::workloads::random_mix(PARALLEL_MIN + 100, 200, 11);
    let p = plan(&ivs, 256);
    let t = Timeline::new(&ivs, 256);
    for (h, (name, arena)) in Heuristic::ALL.iter().zip(&p.tried) {
        let fit = best_fit::place_in_order(&t, &h.order(&t));
        assert_eq!((h.name(), fit.arena_bytes), (name.as_str(), *arena));
        if h.name() == p.algorithm {
            assert_eq!(fit.offsets, p.offsets);
        }
    }
    let again = place(&ivs, 256);
    assert_eq!(again, p);
}

#[test]
fn verify_names_the_two_buffers_that_overlap() {
    let ivs = chain(4, 256);
    let mut p = place(&ivs, 256);
    p.offsets[2] = p.offsets[1];
    let err = verify(&ivs, &p, 256).unwrap_err();
    assert!(err.contains("interval 1") && err.contains("interval 2"), "{err}");
}

#[test]
fn placements_round_trip_through_json() {
    let ivs = chain(3, 100);
    let p = place(&ivs, 256);
    let json = serde_json::to_string(&p).unwrap();
    assert_eq!(serde_json::from_str::<Placement>(&json).unwrap(), p);
    let json = serde_json::to_string(&ivs).unwrap();
    assert_eq!(serde_json::from_str::<Vec<Interval>>(&json).unwrap(), ivs);
}

#[test]
#[should_panic(expected = "ends before it starts")]
fn an_interval_that_ends_before_it_starts_is_a_bug() {
    place(&[iv(10, 5, 4)], 256);
}
