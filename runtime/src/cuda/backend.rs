//! The CUDA backend: per plan, one arena allocation and one io allocation made at `load`;
//! variables allocated once when first declared; every step's kernels generated per shape,
//! compiled by NVRTC (cached) and launched on base + offset pointers, all on one stream. A
//! training step allocates nothing: `device_allocations` counts every allocation this backend
//! ever made, so a test can check that it does not move while steps run.

use super::nvrtc::{CompileStats, NvrtcCompiler};
use super::probe::{self, DeviceInfo};
use crate::backend::{Backend, ProgramId, check_input};
use crate::error::{Result, RuntimeError};
use crate::init::initial_values;
use crate::tensor::HostTensor;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use kiln_compiler::Plan;
use kiln_compiler::ir::Shape;
use kiln_compiler::plan::{Storage, VariableSpec};
use kiln_kernels::cuda::{self, Arg, CudaKernel};
use std::collections::HashMap;
use std::sync::Arc;

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::Cuda(format!("{what}: {e:?}"))
}

struct BoundLaunch {
    function: CudaFunction,
    config: LaunchConfig,
    args: Vec<u64>,
}

struct Program {
    plan: Plan,
    /// One arena per device of the plan (logical devices of this GPU), held for the launches.
    _arenas: Vec<CudaSlice<u8>>,
    ios: Vec<CudaSlice<u8>>,
    launches: Vec<BoundLaunch>,
}

struct Variable {
    spec: VariableSpec,
    data: CudaSlice<u8>,
}

pub struct CudaBackend {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    compiler: Arc<NvrtcCompiler>,
    seed: u64,
    variables: HashMap<String, Variable>,
    programs: Vec<Program>,
    modules: HashMap<String, Arc<CudaModule>>,
    device_allocations: u64,
    device_allocated_bytes: usize,
}

/// Generates the CUDA kernels of every step of `plan` (no device needed): what the backend
/// compiles and launches, in order.
pub fn plan_kernels(plan: &Plan) -> Result<Vec<CudaKernel>> {
    let scalar = Shape::scalar();
    plan.steps
        .iter()
        .map(|step| {
            let ins: Vec<_> =
                step.inputs.iter().map(|&v| (&plan.values[v].shape, plan.values[v].dtype)).collect();
            let out = match step.output {
                Some(o) => (&plan.values[o].shape, plan.values[o].dtype),
                None => (&scalar, ins.first().map(|i| i.1).unwrap_or_default()),
            };
            Ok(cuda::generate(&step.op, &ins, out)?)
        })
        .collect()
}

impl CudaBackend {
    /// The backend of CUDA device `ordinal`, or why there is none.
    pub fn new(ordinal: usize, seed: u64) -> Result<Self> {
        let found = probe::probe();
        found.usable().map_err(RuntimeError::Cuda)?;
        let devices = found.devices.map_err(RuntimeError::Cuda)?;
        let info = devices
            .into_iter()
            .find(|d| d.ordinal == ordinal)
            .ok_or_else(|| RuntimeError::Cuda(format!("no CUDA device {ordinal}")))?;
        let ctx = CudaContext::new(ordinal).map_err(driver("creating the context"))?;
        // One stream runs every step in order: cudarc's per-buffer event tracking is not needed.
        // SAFETY: called before any allocation or launch on this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let compiler = Arc::new(NvrtcCompiler::new(info.compute_capability)?);
        Ok(CudaBackend {
            info,
            ctx,
            stream,
            compiler,
            seed,
            variables: HashMap::new(),
            programs: Vec::new(),
            modules: HashMap::new(),
            device_allocations: 0,
            device_allocated_bytes: 0,
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Every device allocation this backend made, and their bytes: constant while steps run.
    pub fn device_allocations(&self) -> (u64, usize) {
        (self.device_allocations, self.device_allocated_bytes)
    }

    /// The driver's free and total bytes of the device (what nvidia-smi shows).
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(driver("cuMemGetInfo"))
    }

    pub fn compile_stats(&self) -> CompileStats {
        self.compiler.stats()
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Kernel launches per run of `program`.
    pub fn launches(&self, program: ProgramId) -> usize {
        self.programs[program].launches.len()
    }

    fn alloc(&mut self, bytes: usize) -> Result<CudaSlice<u8>> {
        let slice = self.stream.alloc_zeros::<u8>(bytes.max(1)).map_err(driver("cuMemAlloc"))?;
        self.device_allocations += 1;
        self.device_allocated_bytes += bytes.max(1);
        Ok(slice)
    }

    fn ptr(&self, slice: &CudaSlice<u8>) -> u64 {
        let (p, _sync) = slice.device_ptr(&self.stream);
        p
    }

    fn ensure_variable(&mut self, spec: &VariableSpec) -> Result<u64> {
        if let Some(v) = self.variables.get(&spec.key) {
            if v.spec.shape != spec.shape || v.spec.dtype != spec.dtype {
                return Err(RuntimeError::VariableShape {
                    key: spec.key.clone(),
                    existing: v.spec.shape.clone(),
                    requested: spec.shape.clone(),
                    help: "a variable keeps its shape across plans".into(),
                });
            }
            return Ok(self.ptr(&v.data));
        }
        let mut data = self.alloc(spec.bytes())?;
        let values = initial_values(spec.init, &spec.shape, self.seed, &spec.key);
        self.stream
            .memcpy_htod(bytemuck::cast_slice::<f32, u8>(&values), &mut data)
            .map_err(driver("copying a variable"))?;
        let p = self.ptr(&data);
        self.variables.insert(spec.key.clone(), Variable { spec: spec.clone(), data });
        Ok(p)
    }

    /// "cuda:0".
    pub fn describe_short(&self) -> String {
        format!("cuda:{}", self.info.ordinal)
    }

    /// The NVRTC compiler and its caches, shared with the eager executor.
    pub fn compiler(&self) -> &Arc<NvrtcCompiler> {
        &self.compiler
    }

    fn module(&mut self, key: &str, ptx: &str) -> Result<Arc<CudaModule>> {
        if let Some(m) = self.modules.get(key) {
            return Ok(m.clone());
        }
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(driver("loading a compiled kernel (cuModuleLoadData)"))?;
        self.modules.insert(key.to_string(), m.clone());
        Ok(m)
    }
}

impl Backend for CudaBackend {
    fn describe(&self) -> String {
        let (major, minor) = self.info.compute_capability;
        format!(
            "cuda:{} ({}, sm_{major}{minor}, {:.1} GiB)",
            self.info.ordinal,
            self.info.name,
            self.info.total_bytes as f64 / (1u64 << 30) as f64
        )
    }

    fn load(&mut self, plan: Plan) -> Result<ProgramId> {
        let var_ptrs: Vec<u64> =
            plan.variables.iter().map(|v| self.ensure_variable(v)).collect::<Result<_>>()?;
        let kernels = plan_kernels(&plan)?;
        let sources: Vec<&str> = kernels.iter().map(|k| k.source.as_str()).collect();
        let ptx = self.compiler.compile_all(&sources)?;
        let arenas: Vec<CudaSlice<u8>> =
            plan.devices.iter().map(|d| self.alloc(d.memory.arena_bytes)).collect::<Result<_>>()?;
        let ios: Vec<CudaSlice<u8>> =
            plan.devices.iter().map(|d| self.alloc(d.memory.io_bytes)).collect::<Result<_>>()?;
        let arena_base: Vec<u64> = arenas.iter().map(|a| self.ptr(a)).collect();
        let io_base: Vec<u64> = ios.iter().map(|a| self.ptr(a)).collect();
        let address = |value: usize| -> u64 {
            match plan.buffers[plan.values[value].buffer].storage {
                Storage::Arena { device, offset } => arena_base[device] + offset as u64,
                Storage::Io { device, offset } => io_base[device] + offset as u64,
                Storage::Variable { index } => var_ptrs[index],
            }
        };
        let mut launches = Vec::new();
        for ((step, kernel), ptx) in plan.steps.iter().zip(&kernels).zip(&ptx) {
            let key = self.compiler.key(&kernel.source);
            let module = self.module(&key, ptx)?;
            for l in &kernel.launches {
                let function = module
                    .load_function(&l.function)
                    .map_err(driver(&format!("finding kernel function `{}`", l.function)))?;
                let args = l
                    .args
                    .iter()
                    .map(|a| match a {
                        Arg::Input(i) => Ok(address(step.inputs[*i])),
                        Arg::Output => step.output.map(address).ok_or_else(|| {
                            RuntimeError::Cuda(format!(
                                "kernel `{}` wants an output but `{}` has none",
                                l.function, step.label
                            ))
                        }),
                    })
                    .collect::<Result<Vec<u64>>>()?;
                let config = LaunchConfig {
                    grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
                    block_dim: (l.block[0], l.block[1], l.block[2]),
                    shared_mem_bytes: l.shared_bytes,
                };
                launches.push(BoundLaunch { function, config, args });
            }
        }
        self.programs.push(Program { plan, _arenas: arenas, ios, launches });
        Ok(self.programs.len() - 1)
    }

    fn plan(&self, program: ProgramId) -> &Plan {
        &self.programs[program].plan
    }

    fn set_input(&mut self, program: ProgramId, name: &str, shape: &Shape, data: &[f32]) -> Result<()> {
        let p = &mut self.programs[program];
        let value = check_input(&p.plan, name, shape, data.len())?;
        let Storage::Io { device, offset } = p.plan.buffers[p.plan.values[value].buffer].storage else {
            return Err(RuntimeError::invalid(
                format!("input `{name}` is not in the io region"),
                "recompile",
            ));
        };
        let bytes = bytemuck::cast_slice::<f32, u8>(data);
        let mut view = p.ios[device].slice_mut(offset..offset + bytes.len());
        self.stream.memcpy_htod(bytes, &mut view).map_err(driver("copying an input to the device"))
    }

    fn run(&mut self, program: ProgramId) -> Result<()> {
        let p = &self.programs[program];
        for l in &p.launches {
            let mut builder = self.stream.launch_builder(&l.function);
            for a in &l.args {
                builder.arg(a);
            }
            // SAFETY: the arguments are device pointers into the plan's arena, io region and
            // variables, allocated at load with the plan's sizes; the kernel was generated for
            // exactly these shapes and argument order.
            unsafe { builder.launch(l.config) }.map_err(driver("launching a kernel"))?;
        }
        Ok(())
    }

    fn output(&self, program: ProgramId, name: &str) -> Result<HostTensor> {
        let p = &self.programs[program];
        let Some(b) = p.plan.output(name) else {
            return Err(RuntimeError::invalid(format!("plan {:?} has no output `{name}`", p.plan.name), ""));
        };
        let v = p.plan.value(b.value);
        let Storage::Io { device, offset } = p.plan.buffers[v.buffer].storage else {
            return Err(RuntimeError::invalid(
                format!("output `{name}` is not in the io region"),
                "recompile",
            ));
        };
        let mut host = vec![0f32; v.shape.numel()];
        let view = p.ios[device].slice(offset..offset + host.len() * 4);
        self.stream
            .memcpy_dtoh(&view, bytemuck::cast_slice_mut::<f32, u8>(&mut host))
            .map_err(driver("copying an output to the host"))?;
        self.stream.synchronize().map_err(driver("waiting for the stream"))?;
        HostTensor::new(v.shape.clone(), host)
    }

    fn read_variable(&self, key: &str) -> Result<HostTensor> {
        let v = self
            .variables
            .get(key)
            .ok_or_else(|| RuntimeError::invalid(format!("no variable `{key}`"), ""))?;
        let mut host = vec![0f32; v.spec.shape.numel()];
        self.stream
            .memcpy_dtoh(&v.data.slice(0..host.len() * 4), bytemuck::cast_slice_mut::<f32, u8>(&mut host))
            .map_err(driver("copying a variable to the host"))?;
        self.stream.synchronize().map_err(driver("waiting for the stream"))?;
        HostTensor::new(v.spec.shape.clone(), host)
    }

    fn write_variable(&mut self, key: &str, value: &HostTensor) -> Result<()> {
        let v = self
            .variables
            .get_mut(key)
            .ok_or_else(|| RuntimeError::invalid(format!("no variable `{key}`"), ""))?;
        if value.shape() != &v.spec.shape {
            return Err(RuntimeError::VariableShape {
                key: key.into(),
                existing: v.spec.shape.clone(),
                requested: value.shape().clone(),
                help: "write a tensor of the variable's shape".into(),
            });
        }
        let bytes = bytemuck::cast_slice::<f32, u8>(value.data());
        let mut view = v.data.slice_mut(0..bytes.len());
        self.stream.memcpy_htod(bytes, &mut view).map_err(driver("copying a variable to the device"))
    }
}
