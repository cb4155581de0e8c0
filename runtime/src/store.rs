//! Persistent variables of one device (parameters, optimizer state, counters), shared by every
//! plan loaded on it: plans compiled for another batch size find the same variables by key.

use crate::error::{Result, RuntimeError};
use crate::host_buffer::HostMem;
use crate::init::initial_values;
use crate::tensor::HostTensor;
use kiln_compiler::ir::VarRole;
use kiln_compiler::plan::VariableSpec;
use std::collections::HashMap;

struct Slot {
    spec: VariableSpec,
    data: HostMem,
}

/// Variables in host memory, each taken once (from its device's budget) when first declared.
pub struct VariableStore {
    seed: u64,
    slots: Vec<Slot>,
    index: HashMap<String, usize>,
}

impl VariableStore {
    pub fn new(seed: u64) -> Self {
        VariableStore { seed, slots: Vec::new(), index: HashMap::new() }
    }

    /// The slot of `spec`'s variable, created in memory from `take` and initialised on first sight.
    pub fn ensure(
        &mut self,
        spec: &VariableSpec,
        take: impl FnOnce(usize) -> Result<HostMem>,
    ) -> Result<usize> {
        if let Some(&i) = self.index.get(&spec.key) {
            let existing = &self.slots[i].spec;
            if existing.shape != spec.shape || existing.dtype != spec.dtype {
                return Err(RuntimeError::VariableShape {
                    key: spec.key.clone(),
                    existing: existing.shape.clone(),
                    requested: spec.shape.clone(),
                    help: "a variable keeps its shape across plans; check that the model builds the same layers for every input shape".into(),
                });
            }
            return Ok(i);
        }
        let mut data = take(spec.bytes())?;
        let values = initial_values(spec.init, &spec.shape, self.seed, &spec.key);
        data.f32s_mut(0, values.len()).copy_from_slice(&values);
        self.index.insert(spec.key.clone(), self.slots.len());
        self.slots.push(Slot { spec: spec.clone(), data });
        Ok(self.slots.len() - 1)
    }

    /// The base of a slot's memory: for the backends, with slots `ensure` handed out (not public:
    /// a slot number from elsewhere would index out of range).
    pub(crate) fn ptr(&self, slot: usize) -> *mut u8 {
        self.slots[slot].data.as_mut_ptr()
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.slots.iter().map(|s| s.spec.key.as_str())
    }

    pub fn get(&self, key: &str) -> Option<HostTensor> {
        let s = &self.slots[*self.index.get(key)?];
        HostTensor::new(s.spec.shape.clone(), s.data.f32s(0, s.spec.shape.numel()).to_vec()).ok()
    }

    pub fn set(&mut self, key: &str, value: &HostTensor) -> Result<()> {
        let Some(&i) = self.index.get(key) else {
            return Err(RuntimeError::invalid(
                format!("no variable `{key}`"),
                "variables exist once a plan that declares them is loaded",
            ));
        };
        let s = &mut self.slots[i];
        if value.shape() != &s.spec.shape {
            return Err(RuntimeError::VariableShape {
                key: key.into(),
                existing: s.spec.shape.clone(),
                requested: value.shape().clone(),
                help: "write a tensor of the variable's shape".into(),
            });
        }
        s.data.f32s_mut(0, value.data().len()).copy_from_slice(value.data());
        Ok(())
    }

    /// Bytes held by variables with one of `roles`.
    pub fn bytes(&self, roles: &[VarRole]) -> usize {
        self.slots.iter().filter(|s| roles.contains(&s.spec.role)).map(|s| s.data.len()).sum()
    }
}
