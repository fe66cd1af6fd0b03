// onnxruntime-web in the page: which build it imports, and the choices fixed when it starts (execution
// provider, precision, WASM threads). The WebGPU dispatch counter lives here too: it hooks the WebGPU API
// before any session exists.

import { PageError } from './errors.mjs';

// onnxruntime-web, one build per page, chosen by the backend of the first load: on WASM its WASM build
// (14.2 MB of WebAssembly; the same kernels as the other build's WASM EP, a run 5-15 % faster without
// asyncify, and quicker to compile), on WebGPU its WebGPU build (26.8 MB, asyncify), which also runs the
// WASM EP: a fallback to WASM after the GPU device is lost keeps it. Each build's WebAssembly runtime lies
// next to its bundle. `ort` is the module once `startRuntime` has imported it.
const BUILDS = {
  wasm: { bundle: './vendor/ort/ort.wasm.min.mjs', runtime: './vendor/ort/ort-wasm-simd-threaded.wasm' },
  webgpu: { bundle: './vendor/ort/ort.webgpu.min.mjs', runtime: './vendor/ort/ort-wasm-simd-threaded.asyncify.wasm' },
};
export let ort = null;
let build = null;

/** Imports the onnxruntime-web build for `backend`, once per page (later calls keep the first). */
export async function startRuntime(backend) {
  if (!ort) {
    build = BUILDS[backend];
    try {
      ort = await import(build.bundle);
    } catch (e) {
      throw new PageError(`could not load onnxruntime-web from ${new URL(build.bundle, import.meta.url)} (${e.message}): rebuild the site`);
    }
    ort.env.wasm.wasmPaths = new URL('./vendor/ort/', import.meta.url).href;
    ort.env.logLevel = 'error';
  }
  return ort;
}

/** The WebAssembly runtime of the build in use: its URL, and its bytes and sha256 as the site's manifest records them. */
export function runtimeFile(manifest) {
  const url = new URL(build.runtime, import.meta.url);
  const spec = manifest.runtimes?.[build.runtime.replace('./', '')];
  if (!spec) throw new PageError(`the manifest records no sha256 for ${url}: rebuild the site`);
  return { url, ...spec };
}

// The WebGPU compute dispatches onnxruntime-web issues, counted at the WebGPU API: at this model size a
// phone's GPU pays per dispatch more than per FLOP, so dispatches per step model the GPU regime that
// SwiftShader's timings cannot. Each run's count goes into its trace entry.
export const gpuCounter = { dispatches: 0 };
if (globalThis.GPUComputePassEncoder) {
  for (const name of ['dispatchWorkgroups', 'dispatchWorkgroupsIndirect']) {
    const original = GPUComputePassEncoder.prototype[name];
    GPUComputePassEncoder.prototype[name] = function counted(...args) {
      gpuCounter.dispatches += 1;
      return original.apply(this, args);
    };
  }
}

/**
 * Which execution provider to use: `requested` ('webgpu' | 'wasm' | null) forces one; otherwise WebGPU
 * where the browser offers an adapter, WASM else.
 * @returns {Promise<{backend: string, adapter: string|null, note: string, precision: string, precisionNote: string}>}
 */
export async function chooseBackend(requested, precision) {
  if (requested && requested !== 'webgpu' && requested !== 'wasm') {
    throw new PageError(`unknown backend "${requested}": use ?backend=webgpu or ?backend=wasm`);
  }
  if (precision && !['fp16', 'fp32', 'q4'].includes(precision)) {
    throw new PageError(`unknown precision "${precision}": use ?precision=fp16, ?precision=fp32 or ?precision=q4`);
  }
  if (requested === 'wasm') {
    return { backend: 'wasm', adapter: null, note: 'WASM, as requested', ...choosePrecision(precision, 'wasm', false) };
  }
  let adapter = null;
  let why = 'this browser has no WebGPU (navigator.gpu is missing)';
  if (globalThis.navigator?.gpu) {
    try {
      adapter = await navigator.gpu.requestAdapter();
      why = 'the browser offers WebGPU but no adapter';
    } catch (e) {
      why = `requesting a WebGPU adapter failed (${e.message})`;
    }
  }
  if (adapter) {
    const info = adapter.info || {};
    const name = [info.vendor, info.architecture, info.description].filter(Boolean).join(' ') || 'unnamed adapter';
    return { backend: 'webgpu', adapter: name, note: requested ? 'WebGPU, as requested' : 'WebGPU',
      ...choosePrecision(precision, 'webgpu', adapter.features.has('shader-f16')) };
  }
  if (requested === 'webgpu') throw new PageError(`WebGPU was requested but ${why}`);
  return { backend: 'wasm', adapter: null, note: `WASM: ${why}`, ...choosePrecision(precision, 'wasm', false) };
}

/**
 * fp16 where the WebGPU adapter has the shader-f16 feature, fp32 otherwise, unless ?precision= says; on
 * WebGPU q4 before either (`q4: true`) where the site has it (a base imported from a GGUF: its graph on the
 * file's 4- and 8-bit blocks, builder/export/nbits.py). fp16 on WASM (only when asked for) runs the fp16 graphs
 * with onnxruntime's fp32 kernels where it has no fp16 ones: not faster (a model saved in fp16 has its fp32
 * graphs read the same fp16 weights); so does q4 (WASM unpacks the 4 bits on every pass: 6x slower).
 * The site may lack a precision: `loadModels` then uses another.
 */
export function choosePrecision(requested, backend, shaderF16) {
  if (requested === 'fp16' && backend === 'webgpu' && !shaderF16) {
    throw new PageError('fp16 was requested but this WebGPU adapter lacks the shader-f16 feature: use ?precision=fp32');
  }
  if (requested) return { precision: requested, precisionNote: `${requested}, as requested` };
  if (backend === 'webgpu') {
    return shaderF16 ? { precision: 'fp16', precisionNote: 'fp16: the adapter has shader-f16', q4: true }
      : { precision: 'fp32', precisionNote: 'fp32: the adapter lacks shader-f16', q4: true };
  }
  return { precision: 'fp32', precisionNote: 'fp32 on WASM' };
}

/**
 * How many threads onnxruntime-web's WASM runtime uses. It can run several only where the page is
 * cross-origin isolated (SharedArrayBuffer): `serve` sends the COOP/COEP headers, and on a static host
 * that cannot, coi-sw.js adds them. By default one per core, at most 4 (a phone's big cores); `requested`
 * (?threads=N) sets the count. WebGPU runs its graphs on the GPU: one thread. Read once, when the
 * runtime starts (the first session).
 * @returns {{threads: number, threadsNote: string}}
 */
export function chooseThreads(requested, backend, isolated = globalThis.crossOriginIsolated,
  cores = globalThis.navigator?.hardwareConcurrency) {
  if (requested != null && !/^[1-9][0-9]?$/.test(requested)) {
    throw new PageError(`unknown thread count "${requested}": use ?threads=1 to ?threads=99`);
  }
  const wanted = requested ? Number(requested) : Math.min(4, cores || 1);
  const plural = (n) => `${n} WASM thread${n > 1 ? 's' : ''}`;
  if (backend !== 'wasm') return { threads: 1, threadsNote: '' };
  if (!isolated) {
    return { threads: 1, threadsNote: `${plural(1)}: the page is not cross-origin isolated` };
  }
  return { threads: wanted, threadsNote: plural(wanted) + (requested ? ', as requested' : ` (${cores || 1} cores)`) };
}
