// Loading the models with onnxruntime-web: the execution provider and precision, the manifest, the
// tokenizer, and the sessions of the graphs (`Sessions`). Everything about the graphs (files, input and
// output names, KV layout, k, special tokens, task formats) comes from models/manifest.json, written by
// `python -m builder build`.
//
// Every file is downloaded with progress and checked against the manifest's sha256, and the model files
// kept in Cache Storage for the next visit. A graph's weights
// (ONNX external data) are downloaded once per page and shared by every session that lists them (the
// base's file serves the base and every head graph). Sessions are created one at a time and every
// session.run goes through one promise chain (DESIGN.md); a failed run names each input. On WebGPU the
// tensors runs leave on the GPU are counted until disposed, and the device is watched for loss.

import { Tokenizer } from './vendor/tokenizers/tokenizers.min.mjs';
import { DeviceLostError, PageError } from './errors.mjs';
import { TaskTokenizer } from './tasks.mjs';

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
async function startRuntime(backend) {
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

const FORMAT = 'frozen-mtp-onnx/2';

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
  if (precision && precision !== 'fp16' && precision !== 'fp32') {
    throw new PageError(`unknown precision "${precision}": use ?precision=fp16 or ?precision=fp32`);
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
 * fp16 where the WebGPU adapter has the shader-f16 feature, fp32 otherwise, unless ?precision= says.
 * fp16 on WASM (only when asked for) runs the fp16 graphs with onnxruntime's fp32 kernels where it has
 * no fp16 ones: not faster (a model saved in fp16 has its fp32 graphs read the same fp16 weights).
 * The site may lack a precision: `loadModels` then uses the other.
 */
export function choosePrecision(requested, backend, shaderF16) {
  if (requested === 'fp16' && backend === 'webgpu' && !shaderF16) {
    throw new PageError('fp16 was requested but this WebGPU adapter lacks the shader-f16 feature: use ?precision=fp32');
  }
  if (requested) return { precision: requested, precisionNote: `${requested}, as requested` };
  if (backend === 'webgpu') {
    return shaderF16 ? { precision: 'fp16', precisionNote: 'fp16: the adapter has shader-f16' }
      : { precision: 'fp32', precisionNote: 'fp32: the adapter lacks shader-f16' };
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

const hex = async (data) => [...new Uint8Array(await crypto.subtle.digest('SHA-256', data))]
  .map((b) => b.toString(16).padStart(2, '0')).join('');

// Model files stay in Cache Storage after a verified download, keyed by their sha256: a second visit
// fetches no model bytes, and a rebuilt site's changed files are new keys. Absent (an insecure origin,
// storage disabled), files are simply downloaded.
const CACHE = 'frozen-mtp-models';
const openCache = () => (globalThis.caches ? caches.open(CACHE).catch(() => null) : Promise.resolve(null));
const cacheKey = (url, sha256) => `${url.href.split('?')[0]}?sha256=${sha256}`;

/**
 * A model file: from Cache Storage when it holds this very file (its sha256 checked again), else
 * downloaded, checked and stored.
 */
async function fetchModelFile(url, { sha256, bytes, onBytes } = {}) {
  const cache = await openCache();
  const hit = await cache?.match(cacheKey(url, sha256)).catch(() => null);
  if (hit) {
    const data = new Uint8Array(await hit.arrayBuffer());
    if (await hex(data) === sha256) {
      onBytes?.(data.length);
      return data;
    }
    await cache.delete(cacheKey(url, sha256));  // damaged in storage: download it again
  }
  const data = await fetchBytes(url, { sha256, bytes, onBytes });
  await cache?.put(cacheKey(url, sha256), new Response(data)).catch(() => {});  // e.g. over quota: not kept
  return data;
}

/**
 * The WebAssembly runtime of the onnxruntime-web build in use (14.2 or 26.8 MB, the largest file after the
 * base's weights), kept in Cache Storage under onnxruntime-web's version like the model files, with the
 * same progress bar; handed to onnxruntime as `env.wasm.wasmBinary`, so that it does not fetch it again.
 */
async function fetchRuntime(onProgress) {
  const url = new URL(build.runtime, import.meta.url);
  const key = `${url.href}?ort=${ort.env.versions.web}`;
  const cache = await openCache();
  const hit = await cache?.match(key).catch(() => null);
  if (hit) return new Uint8Array(await hit.arrayBuffer());
  let loaded = 0;
  const data = await fetchBytes(url, { onBytes: (n, total) => onProgress?.(loaded += n, total, 'the WebAssembly runtime') });
  onProgress?.(data.length, data.length, 'the WebAssembly runtime');  // done, also where no total was known
  if (cache) {
    for (const old of await cache.keys()) if (old.url.startsWith(`${url.href}?`) && old.url !== key) await cache.delete(old);
    await cache.put(key, new Response(data)).catch(() => {});
  }
  return data;
}

/** Drops cached model files the manifest no longer lists (a rebuilt site's old weights). */
async function pruneCache(modelsUrl, manifest) {
  const cache = await openCache();
  if (!cache) return;
  const keep = new Set(Object.entries(manifest.files).map(([f, m]) => cacheKey(new URL(f, modelsUrl), m.sha256)));
  for (const request of await cache.keys()) {
    if (request.url.startsWith(modelsUrl.href) && !keep.has(request.url)) await cache.delete(request);
  }
}

/**
 * Fetches a file of the site, reporting bytes as they arrive (with the size the server announced, or 0
 * when unknown); checks its sha256 when one is given.
 */
async function fetchBytes(url, { sha256, bytes, onBytes } = {}) {
  let response;
  try {
    response = await fetch(url);
  } catch (e) {
    throw new PageError(`could not download ${url} (${e.message})`);
  }
  if (response.status === 404) throw new PageError(`${url} is missing from the site (HTTP 404): rebuild the site`);
  if (!response.ok) throw new PageError(`could not download ${url}: HTTP ${response.status} ${response.statusText}`);
  // a gzip-encoded response announces its encoded size; the bytes read here are decoded: no total then
  const total = response.headers.get('content-encoding') ? 0 : Number(response.headers.get('content-length')) || 0;
  const reader = response.body.getReader();
  const chunks = [];
  for (let got; !(got = await reader.read()).done;) {
    chunks.push(got.value);
    onBytes?.(got.value.length, total);
  }
  const data = new Uint8Array(chunks.reduce((n, c) => n + c.length, 0));
  chunks.reduce((at, c) => { data.set(c, at); return at + c.length; }, 0);
  if (sha256) {
    const digest = await hex(data);
    if (digest !== sha256) {
      throw new PageError(`${url} is altered or truncated: ${data.length} bytes with sha256 ${digest.slice(0, 16)}.., ` +
        `the manifest says ${bytes} bytes with sha256 ${sha256.slice(0, 16)}..`);
    }
  }
  return data;
}

/**
 * Reads the manifest and the tokenizer under `modelsUrl` (the models/ folder's URL), then opens the
 * graphs `open(manifest)` names (the rest open when first used). A precision the site lacks falls back to
 * the one it has (see `sessions.precision`).
 * @param {URL} modelsUrl
 * @param {{backend: string, precision: string, threads?: number, open: (manifest: object) => string[],
 *   onProgress?: (loaded: number, total: number, file: string) => void, onLost?: (info: object) => void}} options
 *   onLost: called once if the WebGPU device is lost
 * @returns {Promise<{manifest: object, tokenizer: TaskTokenizer, sessions: Sessions}>}
 */
export async function loadModels(modelsUrl, { backend, precision, threads = 1, open, onProgress, onLost }) {
  await startRuntime(backend);
  ort.env.wasm.numThreads = threads;  // read when the WebAssembly runtime starts, with the first session
  const manifestUrl = new URL('manifest.json', modelsUrl);
  const manifest = JSON.parse(new TextDecoder().decode(await fetchBytes(manifestUrl)));
  if (manifest.format !== FORMAT) {
    throw new PageError(`${manifestUrl} is not a ${FORMAT} manifest (format ${manifest.format}): rebuild the site`);
  }
  const json = JSON.parse(new TextDecoder().decode(
    await fetchModelFile(new URL(manifest.tokenizer, modelsUrl), manifest.files[manifest.tokenizer])));
  pruneCache(modelsUrl, manifest);  // in the background
  // special tokens are encoded by id, never parsed out of the user's text: the JS tokenizer gets no added tokens
  const tokenizer = new TaskTokenizer(new Tokenizer({ ...json, added_tokens: [] }, {}), manifest);
  ort.env.wasm.wasmBinary ??= await fetchRuntime(onProgress);  // read when the runtime starts
  const built = Object.keys(manifest.precisions);
  const sessions = new Sessions(manifest, modelsUrl, backend, built.includes(precision) ? precision : built[0],
    { onProgress, onLost });
  await sessions.open(open(manifest));
  return { manifest, tokenizer, sessions };
}

/** The sessions of the manifest's graphs in one backend and precision, opened when first needed. */
export class Sessions {
  constructor(manifest, modelsUrl, backend, precision, { onProgress, onLost } = {}) {
    this.manifest = manifest;
    this.modelsUrl = modelsUrl;
    this.backend = backend;      // 'webgpu' | 'wasm'
    this.precision = precision;  // 'fp32' | 'fp16'
    this.graphs = manifest.precisions[precision].graphs;  // name -> {file, weights, inputs, outputs}
    this.dtype = manifest.precisions[precision].dtype;    // of every float input and output, the KV cache's
    this.onProgress = onProgress;
    this.onLost = onLost;
    this.sessions = {};              // graph name -> promise of its session
    this.weights = {};               // weights file -> promise of its checked bytes: fetched once per page
    this.queue = Promise.resolve();  // every session.run goes through this one chain
    this.gpuTensors = new Set();     // every GPU tensor a run returned and nobody disposed yet
    this.bufferIds = new WeakMap();  // GPUBuffer -> a number, for traces
    this.buffers = 0;
    this.device = null;              // the WebGPU device watched for loss
    this.lost = null;                // once that device is lost: its GPUDeviceLostInfo
  }

  /** Opens graphs one at a time (DESIGN.md), with one progress bar over the files they still need. */
  async open(names) {
    const todo = names.filter((name) => !this.sessions[name]);
    const files = new Set(todo.flatMap((name) => [this.graphs[name].file, ...this.graphs[name].weights])
      .filter((file) => !this.weights[file]));
    const total = [...files].reduce((sum, file) => sum + this.manifest.files[file].bytes, 0);
    let loaded = 0;
    const onBytes = (file) => (n) => { loaded += n; this.onProgress?.(loaded, total, file); };
    for (const name of todo) {
      this.sessions[name] = this.create(name, onBytes);
      await this.sessions[name];
    }
  }

  fetch(file, onBytes) {
    return fetchModelFile(new URL(file, this.modelsUrl), { ...this.manifest.files[file], onBytes: onBytes(file) });
  }

  /** Downloads a graph and its weights not yet here, each checked against its sha256; creates its session. */
  async create(name, onBytes) {
    const graph = this.graphs[name];
    const model = await this.fetch(graph.file, onBytes);
    const externalData = [];
    for (const path of graph.weights) {
      externalData.push({ path, data: await (this.weights[path] ??= this.fetch(path, onBytes)) });
    }
    // only token ids come back: every float output stays where it was computed
    const preferredOutputLocation = Object.fromEntries(
      graph.outputs.map((o) => [o.name, o.dtype === 'int64' ? 'cpu' : 'gpu-buffer']));
    try {
      const session = await ort.InferenceSession.create(model, {
        executionProviders: [this.backend],
        graphOptimizationLevel: 'all',
        externalData,
        ...(this.backend === 'webgpu' ? { preferredOutputLocation } : {}),
      });
      this.watchDevice();
      return session;
    } catch (e) {
      throw new PageError(`could not open ${graph.file} on ${this.backend}: ${e.message}`);
    }
  }

  /** Watches the WebGPU device onnxruntime-web created (with the first session) for loss. */
  watchDevice() {
    const device = ort.env.webgpu?.device;
    if (this.backend !== 'webgpu' || this.device || !device?.lost) return;
    this.device = device;
    device.lost.then((info) => {
      this.lost = info;
      this.onLost?.(info);
    });
  }

  /** Whether the device is lost, waiting a moment for its lost promise when a run has just failed. */
  async deviceLost() {
    if (this.lost || !this.device) return this.lost;
    await Promise.race([this.device.lost, new Promise((resolve) => { setTimeout(resolve, 200); })]);
    return this.lost;
  }

  /**
   * Runs a graph through the one promise chain (opening it first if needed); a failure names every input.
   * @param {string} name
   * @param {Object<string, ort.Tensor>} feeds
   * @param {object[]|null} trace  when given, the run's inputs and outputs are appended to it
   */
  run(name, feeds, trace = null) {
    const result = this.queue.then(async () => {
      if (!this.sessions[name]) await this.open([name]);
      const session = await this.sessions[name];
      const lost = (info) => new DeviceLostError(`the GPU device was lost (${info.reason}: ${info.message})`);
      if (this.lost) throw lost(this.lost);
      let outputs;
      const dispatched = gpuCounter.dispatches;
      const t0 = performance.now();
      try {
        outputs = await session.run(feeds);
      } catch (e) {
        if (await this.deviceLost()) throw lost(this.lost);
        const inputs = Object.entries(feeds).map(([n, t]) => `${n} ${t.type}[${t.dims}] on ${t.location}`).join(', ');
        throw new PageError(`${name} graph failed on ${this.backend} (${e.message}); inputs: ${inputs}`);
      }
      const ms = performance.now() - t0;  // on WebGPU: until the outputs exist as buffers, not until computed
      for (const t of Object.values(outputs)) if (t.location === 'gpu-buffer') this.gpuTensors.add(t);
      trace?.push({ graph: name, inputs: this.describe(feeds), outputs: this.describe(outputs),
        dispatches: gpuCounter.dispatches - dispatched, ms });
      return outputs;
    });
    this.queue = result.catch(() => {});
    return result;
  }

  /** Tensors as a trace shows them: dtype, dims, location and, on the GPU, which buffer (a stable number). */
  describe(tensors) {
    return Object.fromEntries(Object.entries(tensors).map(([name, t]) => {
      const d = { dtype: t.type, dims: [...t.dims], location: t.location };
      if (t.location === 'gpu-buffer') {
        if (!this.bufferIds.has(t.gpuBuffer)) this.bufferIds.set(t.gpuBuffer, (this.buffers += 1));
        d.buffer = this.bufferIds.get(t.gpuBuffer);
      }
      return [name, d];
    }));
  }

  /** Disposes a tensor a run returned (a no-op for CPU tensors and views) and stops counting it. */
  dispose(t) {
    if (this.gpuTensors.delete(t)) t.dispose();
  }

  /** Closes every session once the run in flight is over (the page is done with them: its device was lost). */
  async close() {
    await this.queue;
    for (const t of this.gpuTensors) t.dispose();
    this.gpuTensors.clear();
    for (const pending of Object.values(this.sessions)) {
      try {
        await (await pending).release();
      } catch { /* a session that never opened, or died with its device: nothing to release */ }
    }
    this.sessions = {};
  }
}
