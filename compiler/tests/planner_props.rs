//! Property tests of the planner over random interval sets (sizes 0..1 MiB, short and long
//! lifetimes, up to a few hundred intervals), against plain quadratic references.

use kiln_compiler::planner::timeline::Timeline;
use kiln_compiler::planner::{
    Bound, Heuristic, Interval, align, best_fit, lower_bound, naive_bytes, place, verify,
};
use proptest::prelude::*;

const MIB: usize = 1 << 20;

/// Mostly short lifetimes, some long ones; sizes 0..1 MiB with some zeros and many exact repeats.
fn interval() -> impl Strategy<Value = Interval> {
    let bytes = prop_oneof![
        1 => Just(0usize),
        3 => prop::sample::select(vec![256usize, 1000, 4096, 65536, MIB - 1]),
        6 => 0..MIB,
    ];
    let life = prop_oneof![8 => 0usize..4, 2 => 0usize..200];
    (bytes, 0usize..200, life).prop_map(|(bytes, start, life)| Interval { bytes, start, end: start + life })
}

fn intervals(max: usize) -> impl Strategy<Value = Vec<Interval>> {
    prop::collection::vec(interval(), 0..max)
}

fn alignment() -> impl Strategy<Value = usize> {
    prop::sample::select(vec![1usize, 8, 256, 1000])
}

/// Best fit as specified, by scanning every placed buffer: the reference for the indexed one.
/// Fitting holes are visited from the bottom; an exact fit is taken at once; after `budget` of
/// them the smallest so far is taken.
fn reference_best_fit(ivs: &[Interval], alignment: usize, order: &[usize], budget: usize) -> Vec<usize> {
    let mut offsets = vec![0; ivs.len()];
    let mut placed: Vec<usize> = Vec::new();
    for &i in order {
        let size = align(ivs[i].bytes, alignment);
        if size == 0 {
            continue;
        }
        let mut taken: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&j| ivs[j].overlaps_in_time(&ivs[i]))
            .map(|&j| (offsets[j], offsets[j] + align(ivs[j].bytes, alignment)))
            .collect();
        taken.sort();
        let (mut top, mut best, mut seen): (usize, Option<(usize, usize)>, usize) = (0, None, 0);
        let mut chosen = None;
        for (lo, hi) in taken {
            if lo > top && lo - top >= size {
                if best.is_none_or(|(len, _)| lo - top < len) {
                    best = Some((lo - top, top));
                }
                seen += 1;
                if lo - top == size || seen >= budget.max(1) {
                    chosen = best;
                    break;
                }
            }
            top = top.max(hi);
        }
        offsets[i] = chosen.or(best).map_or(top, |(_, offset)| offset);
        placed.push(i);
    }
    offsets
}

/// The live bytes at every step, by brute force.
fn reference_bound(ivs: &[Interval], alignment: usize) -> Bound {
    let last = ivs.iter().map(|iv| iv.end).max().unwrap_or(0);
    let mut bound = Bound { bytes: 0, step: ivs.iter().map(|iv| iv.start).min().unwrap_or(0) };
    for step in 0..=last {
        let live: usize = ivs
            .iter()
            .filter(|iv| iv.start <= step && step <= iv.end)
            .map(|iv| align(iv.bytes, alignment))
            .sum();
        if live > bound.bytes {
            bound = Bound { bytes: live, step };
        }
    }
    bound
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn placements_are_valid_and_framed(ivs in intervals(300), alignment in alignment()) {
        let p = place(&ivs, alignment);
        prop_assert_eq!(verify(&ivs, &p, alignment), Ok(()));
        prop_assert_eq!(p.offsets.len(), ivs.len());
        prop_assert!(p.offsets.iter().all(|o| o % alignment == 0));
        prop_assert_eq!(p.arena_bytes % alignment, 0);
        let bound = lower_bound(&ivs, alignment);
        prop_assert!(p.arena_bytes >= bound.bytes, "arena {} < bound {:?}", p.arena_bytes, bound);
        prop_assert!(p.arena_bytes <= naive_bytes(&ivs, alignment));
        let min = p.tried.iter().map(|(_, a)| *a).min().unwrap();
        prop_assert_eq!(p.arena_bytes, min);
        prop_assert_eq!(p.tried.len(), Heuristic::ALL.len());
        prop_assert!(p.tried.iter().any(|(name, a)| *name == p.algorithm && *a == p.arena_bytes));
        let tight = ivs.iter().zip(&p.offsets).map(|(iv, o)| o + align(iv.bytes, alignment)).max().unwrap_or(0);
        prop_assert_eq!(p.arena_bytes, tight);
        prop_assert_eq!(place(&ivs, alignment), p, "not deterministic");
    }

    #[test]
    fn indexed_best_fit_matches_the_scan(ivs in intervals(200), alignment in alignment()) {
        let t = Timeline::new(&ivs, alignment);
        for h in Heuristic::ALL {
            let order = h.order(&t);
            let mut sorted = order.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..ivs.len()).collect::<Vec<_>>(), "{:?} is not a permutation", h);
            for budget in [usize::MAX, best_fit::SEARCH_BUDGET, 2, 0] {
                let fit = best_fit::place_in_order_with_budget(&t, &order, budget);
                let want = reference_best_fit(&ivs, alignment, &order, budget);
                prop_assert_eq!(&fit.offsets, &want, "{:?}, budget {}", h, budget);
            }
            let fit = best_fit::place_in_order(&t, &order);
            prop_assert_eq!(fit.offsets, reference_best_fit(&ivs, alignment, &order, best_fit::SEARCH_BUDGET));
        }
    }

    #[test]
    fn lower_bound_is_the_peak_of_live_bytes(ivs in intervals(120), alignment in alignment()) {
        prop_assert_eq!(lower_bound(&ivs, alignment), reference_bound(&ivs, alignment));
    }

    #[test]
    fn verify_catches_a_moved_buffer(ivs in intervals(100), pick in any::<prop::sample::Index>()) {
        // Move one buffer onto another that is live with it: verify must object.
        let p = place(&ivs, 256);
        let pairs: Vec<(usize, usize)> = (0..ivs.len())
            .flat_map(|i| (0..ivs.len()).map(move |j| (i, j)))
            .filter(|&(i, j)| i != j && ivs[i].bytes > 0 && ivs[j].bytes > 0 && ivs[i].overlaps_in_time(&ivs[j]))
            .collect();
        prop_assume!(!pairs.is_empty());
        let (i, j) = pairs[pick.index(pairs.len())];
        let mut broken = p.clone();
        broken.offsets[i] = p.offsets[j];
        broken.arena_bytes = broken.arena_bytes.max(p.offsets[j] + align(ivs[i].bytes, 256));
        prop_assert!(verify(&ivs, &broken, 256).is_err());
    }
}
