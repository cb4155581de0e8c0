//! Transposes read in place: a `Permute` that swaps the last two axes of a product's operand
//! becomes the product's operand flag (`Op::MatMul`'s `transpose_a` / `transpose_b`).
//!
//! Both backends' products read an operand transposed through swapped strides, at no cost
//! (`kiln_kernels::cpu::matmul`, the CUDA GEMM's load mapping), but a graph written with an
//! explicit transpose (`x.permute(&[1, 0])`, an ONNX `Transpose` as torch.onnx writes it for a
//! tied head or `k.transpose(-1, -2)`) made a copy of the operand first: GPT-2's tied head read
//! its [vocab, d] token table as a [d, vocab] copy made at step 0 and held until the output
//! layer (154 MB at GPT-2 small, 50257 x 768 f32). Two rewrites, to a fixed point:
//!
//! - **Operands.** A product operand that is a permute of its last two axes (any rank: the
//!   permute keeps the batch axes where they are, so they still broadcast as before) is read as
//!   the permute's operand with the flag flipped. Done only where every reader of the permute can
//!   take it so (products only, not an output): a permute that must exist anyway is left alone,
//!   so that its source and it are not both kept alive longer. The permute, left without
//!   readers, is removed here (its ordering edges move to the products: dead-code elimination
//!   keeps a node that orders an effect).
//! - **Results.** A permute of its last two axes of a product read by that permute alone is the
//!   product with its operands swapped and flags flipped: (A·B)ᵀ = Bᵀ·Aᵀ. This is the gradient
//!   of a transposed parameter (autodiff runs before the pipeline): the tied head's table
//!   gradient was hᵀ·g, [d, vocab], then a [vocab, d] copy; it is now gᵀ·h, made as stored.
//!   Casts between the product and the permute (a mixed-precision product rounded to its half
//!   type, `autocast`) move below the permute, as each element's conversion allows: the
//!   gradient of a transposed weight's half copy is then made as stored too, and its update
//!   can compute it (`product_updates`).
//!
//! Every element is the same sum over k in the same order: the CPU's products sum each element
//! as one chain of fused multiply-adds per 512 of k whatever the operands' strides and whatever
//! M and N (`kiln_kernels::cpu::matmul::Gemm::run`; the gemm crate alone picked another kernel
//! by the strides in thin and small products, and another depth split by M and N). So the
//! rewrite keeps every CPU plan at the bits of the eager executor and the reference interpreter
//! on the graph as written (`tests/robust_graphs.rs`, 5,000 random graphs) and is **on by default**;
//! `CompileOptions::with_transpose_operands(false)` or `KILN_TRANSPOSE_OPERANDS=0` turns it off.
//!
//! Measured (2-core build machine, 64-byte slots, `tests/transpose_operands.rs`'s ONNX heads,
//! vocab 512, width 64, 4 x 32 tokens): the tied head's forward arena 425,984 -> 294,912 B (the
//! [d, vocab] copy gone); its training arena 459,776 -> 459,328 B, 24 -> 22 steps — at the
//! training peak the logits' gradient meets the table's gradient, which is as large as the copy
//! (and the copy had died by then); an untied head exported as Transpose(weight) trains in
//! 459,328 -> 328,256 B, 24 -> 21 steps, since its gradient, made as stored, is read by its
//! update alone and folds into it (`product_updates`). The tied table's gradient, gᵀ·h + the
//! gather's gradient, is planned both apart and as one product with the sum as its epilogue,
//! which waits for the gather's gradient (`fusion::Products::Waiting`): 426,560 B apart and
//! 459,328 B fused here, while GPT-2 small plans smaller fused. The zoo's models write their transposes as flags already
//! (`nn::TiedOutput`, attention's q·kᵀ): `kiln memory transformer` is unchanged (arena
//! 29,192,384 B before and after).

use crate::error::Result;
use crate::ir::{Graph, NodeId, Op};

/// What `rewrite` changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransposeFigures {
    /// Product operands now read through a flag instead of a permuted copy.
    pub operands: usize,
    /// Permutes of a product's result made into the product with its operands swapped.
    pub results: usize,
    /// Permutes removed (no reader left).
    pub removed: usize,
}

impl TransposeFigures {
    /// Whether anything changed.
    pub fn changed(&self) -> bool {
        self.operands + self.results + self.removed > 0
    }
}

/// Whether `perm` swaps the last two axes and keeps the rest where they are.
pub fn swaps_last_two(perm: &[usize]) -> bool {
    let r = perm.len();
    r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p)
}

/// The permute `id` when it swaps its operand's last two axes.
fn last_two_permute(graph: &Graph, id: NodeId) -> Option<NodeId> {
    match &graph.node(id).op {
        Op::Permute { perm } if swaps_last_two(perm) => graph.operands(id).first().copied(),
        _ => None,
    }
}

fn is_output(graph: &Graph, id: NodeId) -> bool {
    graph.outputs().iter().any(|(_, o)| *o == id)
}

/// Rewrites every transpose a product can read in place (`module docs`), to a fixed point.
pub fn rewrite(graph: &mut Graph) -> Result<TransposeFigures> {
    let mut figures = TransposeFigures::default();
    loop {
        let results = products_of_results(graph);
        let (operands, removed) = operands_in_place(graph);
        figures.results += results;
        figures.operands += operands;
        figures.removed += removed;
        if results + operands == 0 {
            return Ok(figures);
        }
    }
}

/// Permute(A·B) of the last two axes, the product read by the permute alone: Bᵀ·Aᵀ. Casts
/// between the two (a half product rounded, `autocast`), each read by the next alone, move
/// below the permute: a cast converts each element where it lies.
fn products_of_results(graph: &mut Graph) -> usize {
    let permutes: Vec<NodeId> = graph.node_ids().filter(|&n| last_two_permute(graph, n).is_some()).collect();
    let mut done = 0;
    for p in permutes {
        let Some(mut mm) = last_two_permute(graph, p) else { continue };
        // The casts between the permute and the product, nearest the permute first.
        let mut casts = Vec::new();
        while matches!(graph.node(mm).op, Op::Cast { .. }) {
            casts.push(mm);
            let Some(&below) = graph.operands(mm).first() else { break };
            mm = below;
        }
        let Op::MatMul { transpose_a, transpose_b } = graph.node(mm).op else { continue };
        let operands = graph.operands(mm);
        let [a, b] = operands[..] else { continue };
        // Each node of the chain read by the next alone, and ordered by nothing else.
        let mut chain = vec![mm];
        chain.extend(casts.iter().rev());
        chain.push(p);
        let alone = chain.windows(2).all(|w| {
            graph.users(w[0]) == [w[1]]
                && !is_output(graph, w[0])
                && graph.control_successors(w[0]).is_empty()
                && graph.control_predecessors(w[1]).is_empty()
                && graph.node(w[0]).device == graph.node(p).device
        });
        if !alone {
            continue;
        }
        let shape = graph.node(p).shape.clone();
        for &n in &chain[..chain.len() - 1] {
            graph.node_mut(n).shape = shape.clone();
        }
        graph.node_mut(mm).op = Op::MatMul { transpose_a: !transpose_b, transpose_b: !transpose_a };
        graph.set_operands(mm, &[b, a]);
        let last = chain[chain.len() - 2];
        for s in graph.control_successors(p) {
            graph.add_control(last, s);
        }
        graph.replace_uses(p, last);
        graph.remove(p);
        done += 1;
    }
    done
}

/// Product operands that are permutes of the last two axes, read through the flag; returns the
/// operands rewritten and the permutes removed.
fn operands_in_place(graph: &mut Graph) -> (usize, usize) {
    let permutes: Vec<NodeId> = graph.node_ids().filter(|&n| last_two_permute(graph, n).is_some()).collect();
    let (mut operands, mut removed) = (0, 0);
    for p in permutes {
        let Some(src) = last_two_permute(graph, p) else { continue };
        let users = graph.users(p);
        let all_products = !users.is_empty()
            && !is_output(graph, p)
            && users.iter().all(|&u| {
                matches!(graph.node(u).op, Op::MatMul { .. }) && graph.node(u).device == graph.node(p).device
            });
        // A reader that runs after an update of the source's storage read the permuted copy of
        // the old value: it cannot read the source in place.
        let after_update = graph.control_successors(p).into_iter().any(|s| {
            users.iter().any(|&u| petgraph::algo::has_path_connecting(graph.petgraph(), s, u, None))
        });
        if !all_products || after_update {
            continue;
        }
        for &u in &users {
            let Op::MatMul { mut transpose_a, mut transpose_b } = graph.node(u).op else { continue };
            for (i, o) in graph.operands(u).into_iter().enumerate() {
                if o != p {
                    continue;
                }
                if i == 0 {
                    transpose_a = !transpose_a;
                } else {
                    transpose_b = !transpose_b;
                }
                graph.replace_operand(u, i, src);
                operands += 1;
            }
            graph.node_mut(u).op = Op::MatMul { transpose_a, transpose_b };
            for s in graph.control_successors(p) {
                graph.add_control(u, s);
            }
            for s in graph.control_predecessors(p) {
                graph.add_control(s, u);
            }
        }
        graph.remove(p);
        removed += 1;
    }
    (operands, removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Init;
    use crate::passes::default_pipeline;
    use crate::trace::Tracer;

    fn count(graph: &Graph, f: impl Fn(&Op) -> bool) -> usize {
        graph.node_ids().filter(|&n| f(&graph.node(n).op)).count()
    }

    fn permutes(graph: &Graph) -> usize {
        count(graph, |op| matches!(op, Op::Permute { .. }))
    }

    fn flags(graph: &Graph) -> Vec<(bool, bool)> {
        graph
            .node_ids()
            .filter_map(|n| match graph.node(n).op {
                Op::MatMul { transpose_a, transpose_b } => Some((transpose_a, transpose_b)),
                _ => None,
            })
            .collect()
    }

    fn rewritten(t: Tracer) -> (Graph, TransposeFigures) {
        let mut graph = t.finish().unwrap();
        default_pipeline().run(&mut graph).unwrap();
        let figures = rewrite(&mut graph).unwrap();
        default_pipeline().run(&mut graph).unwrap();
        (graph, figures)
    }

    #[test]
    fn only_a_swap_of_the_last_two_axes_counts() {
        assert!(swaps_last_two(&[1, 0]));
        assert!(swaps_last_two(&[0, 1, 3, 2]));
        assert!(!swaps_last_two(&[0, 2, 1, 3]));
        assert!(!swaps_last_two(&[1, 0, 3, 2]));
        assert!(!swaps_last_two(&[0]));
        assert!(!swaps_last_two(&[0, 1]));
    }

    #[test]
    fn a_permuted_parameter_is_read_through_the_flag() {
        let t = Tracer::new("head");
        let x = t.input("x", [6, 4]);
        let w = t.param("w", [5, 4], Init::GlorotUniform);
        let y = x.matmul(&w.permute(&[1, 0]));
        t.output("y", &y);
        let (graph, figures) = rewritten(t);
        assert_eq!(figures, TransposeFigures { operands: 1, results: 0, removed: 1 });
        assert_eq!(permutes(&graph), 0);
        assert_eq!(flags(&graph), [(false, true)]);
        let out = graph.output("y").unwrap();
        assert_eq!(graph.node(out).shape.dims(), [6, 5]);
    }

    #[test]
    fn a_permute_with_another_reader_stays() {
        let t = Tracer::new("shared");
        let x = t.input("x", [6, 4]);
        let w = t.param("w", [5, 4], Init::GlorotUniform);
        let wt = w.permute(&[1, 0]);
        t.output("y", &x.matmul(&wt));
        t.output("z", &wt.exp());
        let (graph, figures) = rewritten(t);
        assert!(!figures.changed());
        assert_eq!(permutes(&graph), 1);
        assert_eq!(flags(&graph), [(false, false)]);
    }

    #[test]
    fn a_batch_product_reads_a_swap_of_its_last_two_axes() {
        let t = Tracer::new("batch");
        let q = t.input("q", [2, 3, 7, 8]);
        let k = t.input("k", [2, 3, 7, 8]);
        let w = t.input("w", [8, 7]);
        // q·kᵀ per head, and a permuted left operand against a broadcast right one.
        t.output("scores", &q.matmul(&k.permute(&[0, 1, 3, 2])));
        t.output("left", &q.permute(&[0, 1, 3, 2]).matmul(&w.permute(&[1, 0])));
        let (graph, figures) = rewritten(t);
        assert_eq!(figures.operands, 3);
        assert_eq!(permutes(&graph), 0);
        let mut f = flags(&graph);
        f.sort();
        assert_eq!(f, [(false, true), (true, true)]);
        assert_eq!(graph.node(graph.output("scores").unwrap()).shape.dims(), [2, 3, 7, 7]);
        assert_eq!(graph.node(graph.output("left").unwrap()).shape.dims(), [2, 3, 8, 8]);
    }

    #[test]
    fn a_permute_of_other_axes_is_left_alone() {
        let t = Tracer::new("heads");
        let q = t.input("q", [2, 7, 3, 8]);
        let k = t.input("k", [2, 3, 8, 7]);
        t.output("y", &q.permute(&[0, 2, 1, 3]).matmul(&k));
        let (graph, figures) = rewritten(t);
        assert!(!figures.changed());
        assert_eq!(permutes(&graph), 1);
        assert_eq!(flags(&graph), [(false, false)]);
    }

    #[test]
    fn a_transposed_product_swaps_its_operands() {
        let t = Tracer::new("result");
        let a = t.input("a", [6, 4]);
        let b = t.input("b", [6, 5]);
        // (aᵀ·b)ᵀ = bᵀ·a: the gradient of a transposed weight.
        let g = a.matmul_t(&b, true, false).permute(&[1, 0]);
        t.output("g", &(g * 2.0));
        let (graph, figures) = rewritten(t);
        assert_eq!(figures, TransposeFigures { operands: 0, results: 1, removed: 0 });
        assert_eq!(permutes(&graph), 0);
        assert_eq!(flags(&graph), [(true, false)]);
        let mm = graph.node_ids().find(|&n| matches!(graph.node(n).op, Op::MatMul { .. })).unwrap();
        let operands = graph.operands(mm);
        assert_eq!(
            graph.node(operands[0]).op,
            Op::Input { name: "b".into(), shape: [6, 5].into(), dtype: crate::ir::DType::F32 }
        );
        assert_eq!(graph.node(mm).shape.dims(), [5, 4]);
    }

    #[test]
    fn a_transposed_rounded_product_swaps_its_operands_below_its_casts() {
        use crate::ir::DType;
        let t = Tracer::new("rounded result");
        let a = t.input("a", [6, 4]).cast(DType::BF16);
        let b = t.input("b", [6, 5]).cast(DType::BF16);
        // The gradient of a transposed weight's bf16 copy, widened for its f32 master.
        let g = a.matmul_t(&b, true, false).cast(DType::BF16).permute(&[1, 0]).cast(DType::F32);
        t.output("g", &g);
        let (graph, figures) = rewritten(t);
        assert_eq!(figures, TransposeFigures { operands: 0, results: 1, removed: 0 });
        assert_eq!(permutes(&graph), 0);
        assert_eq!(flags(&graph), [(true, false)]);
        let mm = graph.node_ids().find(|&n| matches!(graph.node(n).op, Op::MatMul { .. })).unwrap();
        let [round] = graph.users(mm)[..] else { panic!("the product has one reader") };
        assert_eq!(graph.node(round).op, Op::Cast { to: DType::BF16 });
        assert_eq!(graph.node(mm).shape.dims(), [5, 4]);
        assert_eq!(graph.node(round).shape.dims(), [5, 4]);
    }
}
