use super::{Layer, invalid_layer};
use crate::trace::Tensor;
use std::collections::HashMap;

/// Layers applied in order, each in its own name scope.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Layer>>,
}

impl Sequential {
    /// A model with no layers yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a layer (Keras's `model.add`).
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, layer: impl Layer + 'static) -> Self {
        self.layers.push(Box::new(layer));
        self
    }

    /// Appends a layer in place.
    pub fn push(&mut self, layer: impl Layer + 'static) {
        self.layers.push(Box::new(layer));
    }

    /// How many layers the model has.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether the model has no layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The layers, in the order they run.
    pub fn layers(&self) -> &[Box<dyn Layer>] {
        &self.layers
    }

    /// The scope name of every layer, Keras style: `dense`, `dense_1`, ...
    pub fn scope_names(&self) -> Vec<String> {
        let mut counts: HashMap<&str, usize> = HashMap::new();
        self.layers
            .iter()
            .map(|l| match l.name() {
                Some(n) => n.to_string(),
                None => {
                    let c = counts.entry(l.kind()).or_default();
                    let name = if *c == 0 { l.kind().to_string() } else { format!("{}_{}", l.kind(), c) };
                    *c += 1;
                    name
                }
            })
            .collect()
    }

    /// Applies layers `range` only (used to split a model over devices). A range outside the
    /// model's layers is an error (recorded in the trace), naming the range and the layer count.
    /// An error inside a layer is reported at the caller's line.
    #[track_caller]
    pub fn forward_range(&self, x: &Tensor, range: std::ops::Range<usize>) -> Tensor {
        if range.start > range.end || range.end > self.layers.len() {
            return invalid_layer(
                x,
                self.kind(),
                format!("layers {}..{} are not a range of its {} layers", range.start, range.end, self.len()),
                "give a range start..end with start <= end <= the number of layers",
            );
        }
        let names = self.scope_names();
        let tracer = x.tracer();
        tracer.attributed_to(std::panic::Location::caller(), || {
            let mut h = x.clone();
            for i in range {
                h = tracer.scope(&names[i], || self.layers[i].forward(&h));
            }
            h
        })
    }
}

impl Layer for Sequential {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.forward_range(x, 0..self.layers.len())
    }

    fn kind(&self) -> &'static str {
        "sequential"
    }
}

impl AsRef<Sequential> for Sequential {
    fn as_ref(&self) -> &Sequential {
        self
    }
}
