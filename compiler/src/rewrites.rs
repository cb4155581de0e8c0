//! `compile`'s graph rewrites as passes (`passes::Pass`), in the pipelines it runs.
//!
//! Each rewrite module keeps its own function (`const_fold::fold`, `transpose_operands::rewrite`,
//! ...); here each becomes a pass that says what it changed and which figures the plan reports
//! of it, so that `compile` reads as two pipelines and a search, and the figures are recorded
//! by the pipeline (`passes::PassLog`) and set on the plan once, not copied by hand at each of
//! its exits.
//!
//! - `before_search`: the cleanup (`passes::default_pipeline`), then the rewrites that make
//!   room for one another, run to a fixed point, each followed by the cleanup where it changed
//!   the graph (constants folded, max-pool gradients through a ReLU, sums of padded slices,
//!   transposes read in place), then the minimum cut of what the backward pass keeps.
//! - `before_fusion` and `fusion`: run on each graph the search plans (a graph with tiled or
//!   folded updates, a block split): convolution input gradients through a ReLU, log-softmax
//!   splits, then fusion; kept apart because recomputation under a memory limit fuses the
//!   unfused graph again with fewer products (`fusion::Products::OverValues`).

use crate::error::Result;
use crate::ir::Graph;
use crate::passes::{Changes, Pass, Pipeline, default_pipeline};
use crate::plan::RewriteFigures;
use crate::widen::HalfKernels;
use crate::{
    CompileOptions, const_fold, conv_relu_grad, fusion, log_softmax_split, pad_sums, pool_relu_grad,
    saved_values, transpose_operands,
};

/// Rounds of the fixed-point group at most: each rewrite there only removes ops or makes one
/// op of several, so a second round rarely changes anything and a third never has.
pub const FIXED_POINT_ROUNDS: usize = 3;

/// The rewrites before the schedule search, as `options` asks for them.
pub fn before_search(options: &CompileOptions) -> Pipeline {
    let group = Pipeline::new()
        .cleaned_if(options.fold_constants, ConstFold, default_pipeline())
        .cleaned(PoolReluGrad, default_pipeline())
        .cleaned(PadSums, default_pipeline())
        .cleaned_if(options.transpose_operands, TransposeOperands, default_pipeline());
    Pipeline::new()
        .then(default_pipeline())
        .fixed_point(group, FIXED_POINT_ROUNDS)
        .with_if(options.save_minimal, SavedValues { budget: options.recompute_budget })
}

/// The rewrites of each planned graph before fusion (with fusion on).
pub fn before_fusion(options: &CompileOptions) -> Pipeline {
    Pipeline::new().with_if(options.fuse, ConvReluGrad).with_if(options.fuse, LogSoftmaxSplit)
}

/// Fusion (with fusion on), taking products as `products` says; then, for kernels without half
/// types, `widen`.
pub fn fusion(options: &CompileOptions, products: fusion::Products) -> Pipeline {
    Pipeline::new()
        .with_if(options.fuse, Fuse(products))
        .with_if(options.half_kernels != HalfKernels::ALL, Widen(options.half_kernels))
}

/// Half values read and written through f32 copies, for the ops whose kernels compute f32
/// (those outside the set: `widen`).
pub struct Widen(pub HalfKernels);

impl Pass for Widen {
    fn name(&self) -> &'static str {
        "widen"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let casts = crate::widen::widen(graph, self.0)?;
        Ok(Changes { rewrites: casts, figures: RewriteFigures::default() })
    }
}

/// Constants computed at compile time (`const_fold`).
pub struct ConstFold;

impl Pass for ConstFold {
    fn name(&self) -> &'static str {
        "const_fold"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let f = const_fold::fold(graph)?;
        let figures =
            RewriteFigures { folded_constants: f.constants, folded_ops: f.ops, ..Default::default() };
        Ok(Changes { rewrites: f.constants, figures })
    }
}

/// Max-pool gradients through a ReLU made one op (`pool_relu_grad`).
pub struct PoolReluGrad;

impl Pass for PoolReluGrad {
    fn name(&self) -> &'static str {
        "pool_relu_grad"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        Ok(Changes::count(pool_relu_grad::rewrite(graph)?))
    }
}

/// A sum of zero-padded slice gradients made one concatenation (`pad_sums`).
pub struct PadSums;

impl Pass for PadSums {
    fn name(&self) -> &'static str {
        "pad_sums"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        Ok(Changes::count(pad_sums::rewrite(graph)?))
    }
}

/// Transposes feeding a product read through its operand flags (`transpose_operands`).
pub struct TransposeOperands;

impl Pass for TransposeOperands {
    fn name(&self) -> &'static str {
        "transpose_operands"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let f = transpose_operands::rewrite(graph)?;
        Ok(Changes::count(f.operands + f.results + f.removed))
    }
}

/// The minimum cut of what a training step keeps for its backward pass (`saved_values`), within
/// a share of the step's FLOPs.
pub struct SavedValues {
    /// The share of the step's FLOPs the recomputation may add.
    pub budget: f64,
}

impl Pass for SavedValues {
    fn name(&self) -> &'static str {
        "saved_values"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let f = saved_values::rewrite(graph, self.budget)?;
        let rewrites = f.recomputed_ops;
        let saved_values = (rewrites > 0).then_some(f);
        Ok(Changes { rewrites, figures: RewriteFigures { saved_values, ..Default::default() } })
    }
}

/// Convolution input gradients fused with the ReLU gradient that reads them (`conv_relu_grad`).
pub struct ConvReluGrad;

impl Pass for ConvReluGrad {
    fn name(&self) -> &'static str {
        "conv_relu_grad"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let n = conv_relu_grad::rewrite(graph)?;
        Ok(Changes { rewrites: n, figures: RewriteFigures { conv_relu_grads: n, ..Default::default() } })
    }
}

/// Log-softmaxes split into their row statistics (`log_softmax_split`).
pub struct LogSoftmaxSplit;

impl Pass for LogSoftmaxSplit {
    fn name(&self) -> &'static str {
        "log_softmax_split"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let f = log_softmax_split::split(graph)?;
        let figures = RewriteFigures {
            log_softmax_splits: f.split,
            split_added_ops: f.added_ops,
            ..Default::default()
        };
        Ok(Changes { rewrites: f.split, figures })
    }
}

/// Elementwise chains fused into one op each (`fusion`), with products as it says.
pub struct Fuse(pub fusion::Products);

impl Pass for Fuse {
    fn name(&self) -> &'static str {
        "fusion"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let f = fusion::fuse(graph, self.0)?;
        let figures = RewriteFigures {
            fused_groups: f.groups,
            fused_ops: f.ops,
            waiting_products: f.waiting,
            ..Default::default()
        };
        Ok(Changes { rewrites: f.groups, figures })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Tracer;

    /// The pipeline before the search records what each pass changed: a transpose read in
    /// place is listed once with its count, and a second round of the group changes nothing.
    #[test]
    fn the_pipeline_records_what_each_pass_changed() {
        let t = Tracer::new("g");
        let x = t.input("x", [4, 8]);
        let w = t.param("w", [3, 8], crate::ir::Init::Zeros);
        t.output("y", &x.matmul(&w.transpose(0, 1)));
        let mut graph = t.finish().unwrap();
        let options = CompileOptions::default();
        let log = before_search(&options).run(&mut graph).unwrap();
        let transposes: Vec<&(String, usize)> =
            log.figures.passes.iter().filter(|(name, _)| name == "transpose_operands").collect();
        assert_eq!(transposes.len(), 1, "{:?}", log.figures.passes);
        assert!(transposes[0].1 >= 1);
        assert!(log.rewrites >= transposes[0].1);
        let again = before_search(&options).run(&mut graph).unwrap();
        assert!(
            again.figures.passes.iter().all(|(name, _)| name != "transpose_operands"),
            "{:?}",
            again.figures.passes
        );
    }
}
