//! Persistent variables of one device (parameters, optimizer state, counters), shared by every
//! plan loaded on it: plans compiled for another batch size find the same variables by key.

use crate::error::{Result, RuntimeError};
use crate::host_buffer::HostMem;
use crate::init::variable_values;
use crate::tensor::HostTensor;
use kiln_compiler::ir::VarRole;
use kiln_compiler::plan::{Plan, VariableSpec};
use std::collections::HashMap;

struct Slot {
    spec: VariableSpec,
    /// Its region, and its byte offset there.
    region: usize,
    offset: usize,
}

/// Variables in host memory. The variables a plan declares on a device that the store does
/// not hold yet are taken together, as one region (one allocation from the device's budget),
/// laid out as the plan lays out its variable region: loading a training step first (as the
/// trainer does) puts every parameter and all optimizer state of a device in one allocation.
/// Variables keep their place when later plans are loaded: a plan that declares more
/// variables takes one more region for just those.
pub struct VariableStore {
    seed: u64,
    slots: Vec<Slot>,
    regions: Vec<HostMem>,
    index: HashMap<String, usize>,
}

/// The variables of `plan` on one device that a backend does not hold yet (`held` says which
/// it does), laid out in one region: the plan's own layout when all of them are new, else the
/// new ones packed in declaration order; `bytes` is the region's size (aligned).
pub(crate) struct NewRegion<'p> {
    pub variables: Vec<&'p VariableSpec>,
    pub offsets: Vec<usize>,
    pub bytes: usize,
}

/// None when every variable of `plan` on `device` is held already.
pub(crate) fn new_region<'p>(
    plan: &'p Plan,
    device: usize,
    held: impl Fn(&str) -> bool,
) -> Option<NewRegion<'p>> {
    let on_device = || plan.variables.iter().filter(move |v| v.device == device);
    let variables: Vec<&VariableSpec> = on_device().filter(|v| !held(&v.key)).collect();
    if variables.is_empty() {
        return None;
    }
    let offsets: Vec<usize> = if variables.len() == on_device().count() {
        variables.iter().map(|v| v.offset).collect()
    } else {
        let mut top = 0;
        variables
            .iter()
            .map(|v| {
                let at = top;
                top += v.bytes().next_multiple_of(plan.alignment);
                at
            })
            .collect()
    };
    let end = variables.iter().zip(&offsets).map(|(v, &at)| at + v.bytes()).max().unwrap_or(0);
    Some(NewRegion { variables, offsets, bytes: end.next_multiple_of(plan.alignment) })
}

impl VariableStore {
    /// An empty store; variables it creates are initialised from `seed` and their keys.
    pub fn new(seed: u64) -> Self {
        VariableStore { seed, slots: Vec::new(), regions: Vec::new(), index: HashMap::new() }
    }

    /// The slot of every variable of `plan` (in `plan.variables` order): the ones already held
    /// are checked against their spec, the others are created, one region per plan device taken
    /// from `take(plan device, bytes)`, and initialised. `plan` was validated (its variable
    /// regions hold every variable it declares).
    pub fn ensure_plan(
        &mut self,
        plan: &Plan,
        mut take: impl FnMut(usize, usize) -> Result<HostMem>,
    ) -> Result<Vec<usize>> {
        for spec in &plan.variables {
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
            }
        }
        for device in 0..plan.devices.len() {
            let Some(region) = new_region(plan, device, |key| self.index.contains_key(key)) else { continue };
            let mut mem = take(device, region.bytes)?;
            let r = self.regions.len();
            for (spec, &offset) in region.variables.iter().zip(&region.offsets) {
                let values = variable_values(plan, spec, self.seed);
                mem.f32s_mut(offset, values.len()).copy_from_slice(&values);
                self.index.insert(spec.key.clone(), self.slots.len());
                self.slots.push(Slot { spec: (*spec).clone(), region: r, offset });
            }
            self.regions.push(mem);
        }
        Ok(plan.variables.iter().map(|v| self.index[&v.key]).collect())
    }

    /// The base of a slot's memory: for the backends, with slots `ensure` handed out (not public:
    /// a slot number from elsewhere would index out of range).
    pub(crate) fn ptr(&self, slot: usize) -> *mut u8 {
        let s = &self.slots[slot];
        // SAFETY: `ensure_plan` placed the slot inside its region (offset + bytes <= its length).
        unsafe { self.regions[s.region].as_mut_ptr().add(s.offset) }
    }

    /// How many regions (allocations) hold the variables, and their bytes.
    pub fn regions(&self) -> impl Iterator<Item = usize> + '_ {
        self.regions.iter().map(HostMem::len)
    }

    /// The keys of the variables held, in the order they were created.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.slots.iter().map(|s| s.spec.key.as_str())
    }

    /// Where variable `key` lives and its shape.
    pub fn locate(&self, key: &str) -> Option<(*mut u8, &kiln_compiler::ir::Shape)> {
        let &i = self.index.get(key)?;
        Some((self.ptr(i), &self.slots[i].spec.shape))
    }

    /// A copy of variable `key`'s values, or None when the store does not hold it.
    pub fn get(&self, key: &str) -> Option<HostTensor> {
        let s = &self.slots[*self.index.get(key)?];
        let data = self.regions[s.region].f32s(s.offset, s.spec.shape.numel());
        HostTensor::new(s.spec.shape.clone(), data.to_vec()).ok()
    }

    /// Overwrites variable `key` with `value`; an error when the store does not hold it or the
    /// shapes differ.
    pub fn set(&mut self, key: &str, value: &HostTensor) -> Result<()> {
        let Some(&i) = self.index.get(key) else {
            return Err(RuntimeError::invalid(
                format!("no variable `{key}`"),
                "variables exist once a plan that declares them is loaded",
            ));
        };
        let s = &self.slots[i];
        if value.shape() != &s.spec.shape {
            return Err(RuntimeError::VariableShape {
                key: key.into(),
                existing: s.spec.shape.clone(),
                requested: value.shape().clone(),
                help: "write a tensor of the variable's shape".into(),
            });
        }
        self.regions[s.region].f32s_mut(s.offset, value.data().len()).copy_from_slice(value.data());
        Ok(())
    }

    /// Bytes held by variables with one of `roles`.
    pub fn bytes(&self, roles: &[VarRole]) -> usize {
        self.slots.iter().filter(|s| roles.contains(&s.spec.role)).map(|s| s.spec.bytes()).sum()
    }
}
