// The models in the page: the manifest, the tokenizer, and the sessions of the graphs (`Sessions`).
// Everything about the graphs (files, input and output names and where each output stays, KV layout, k,
// special tokens, task formats, modes) comes from models/manifest.json, written by `python -m builder build`.
//
// A graph's weights (ONNX external data) are downloaded once per page and shared by every session that
// lists them (the base's file serves the base and every head graph); one with a packed form (a base
// imported from a GGUF: its 4-bit blocks) is rebuilt from that (blocks.mjs). Sessions are created one at a time
// and every session.run goes through one promise chain (DESIGN.md); a failed run names each input. On
// WebGPU the tensors runs leave on the GPU are counted until disposed, and the device is watched for loss.

import { Tokenizer } from './vendor/tokenizers/tokenizers.min.mjs';
import { DeviceLostError, PageError } from './errors.mjs';
import { half, unpack } from './blocks.mjs';
import { fetchBytes, fetchModelFile, fetchRuntime, hex, pruneCache } from './files.mjs';
import { gpuCounter, ort, runtimeFile, startRuntime } from './runtime.mjs';
import { TaskTokenizer, unicodeDigits } from './tasks.mjs';

const FORMAT = 'frozen-mtp-onnx/2';

/**
 * Reads the manifest and the tokenizer under `modelsUrl` (the models/ folder's URL), then opens the
 * graphs `open(manifest)` names (the rest open when first used). `precision`: one, or several in order of
 * preference; one the site lacks falls back to one it has (see `sessions.precision`).
 * @param {URL} modelsUrl
 * @param {{backend: string, precision: string|string[], threads?: number, open: (manifest: object) => string[],
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
  const tokenizer = new TaskTokenizer(new Tokenizer(unicodeDigits({ ...json, added_tokens: [] }), {}), manifest);
  ort.env.wasm.wasmBinary ??= await fetchRuntime(runtimeFile(manifest), onProgress);  // read when the runtime starts
  const built = Object.keys(manifest.precisions);
  const sessions = new Sessions(manifest, modelsUrl, backend, [precision].flat().find((p) => built.includes(p)) ?? built[0],
    { onProgress, onLost });
  await sessions.open(open(manifest));
  return { manifest, tokenizer, sessions };
}

/** A safetensors file's tensors: name -> {dtype, shape, data} (F16 data as its 16-bit words). */
function safetensors(bytes) {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const n = Number(view.getBigUint64(0, true));
  const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + n)));
  const tensors = {};
  for (const [name, t] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const [start, end] = t.data_offsets;
    const raw = bytes.slice(8 + n + start, 8 + n + end);  // a copy: aligned for its typed array
    tensors[name] = { dtype: t.dtype, shape: t.shape, data: t.dtype === 'F16' ? new Uint16Array(raw.buffer) : raw };
  }
  return tensors;
}

/** The sessions of the manifest's graphs in one backend and precision, opened when first needed. */
export class Sessions {
  constructor(manifest, modelsUrl, backend, precision, { onProgress, onLost } = {}) {
    this.manifest = manifest;
    this.modelsUrl = modelsUrl;
    this.backend = backend;      // 'webgpu' | 'wasm'
    this.precision = precision;  // 'fp32' | 'fp16' | 'q4'
    this.graphs = manifest.precisions[precision].graphs;  // name -> {file, weights, inputs, outputs}
    this.dtype = manifest.precisions[precision].dtype;    // of every float input and output, the KV cache's
    this.onProgress = onProgress;
    this.onLost = onLost;
    this.sessions = {};              // graph name -> promise of its session
    this.weights = {};               // weights file -> promise of its checked bytes, while a graph to open reads it
    this.queue = Promise.resolve();  // every session.run goes through this one chain
    this.gpuTensors = new Set();     // every GPU tensor a run returned and nobody disposed yet
    this.bufferIds = new WeakMap();  // GPUBuffer -> a number, for traces
    this.buffers = 0;
    this.adapters = {};              // task (null: none) -> promise of the base graph's adapter inputs for it
    this.device = null;              // the WebGPU device watched for loss
    this.lost = null;                // once that device is lost: its GPUDeviceLostInfo
  }

  /** Opens graphs one at a time (DESIGN.md), with one progress bar over the files they still need. */
  async open(names) {
    const todo = names.filter((name) => !this.sessions[name]);
    const files = new Set(todo.flatMap((name) => [this.graphs[name].file, ...this.graphs[name].weights])
      .filter((file) => !this.weights[file]).map((file) => this.manifest.files[file].packed?.file ?? file));
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

  /** A weights file: downloaded as it is, or rebuilt from its packed form (blocks.mjs) and checked. */
  async weightsFile(path, onBytes) {
    const { packed, bytes, sha256 } = this.manifest.files[path];
    if (!packed) return this.fetch(path, onBytes);
    const data = unpack(packed, await this.fetch(packed.file, onBytes), bytes, this.manifest.blocks);
    if (await hex(data) !== sha256) {
      throw new PageError(`${path} rebuilt from ${packed.file} is not the exported file (sha256 differs): rebuild the site`);
    }
    return data;
  }

  /** Downloads a graph and its weights not yet here, each checked against its sha256; creates its session. */
  async create(name, onBytes) {
    const graph = this.graphs[name];
    const model = await this.fetch(graph.file, onBytes);
    const externalData = [];
    for (const path of graph.weights) {
      externalData.push({ path, data: await (this.weights[path] ??= this.weightsFile(path, onBytes)) });
    }
    // where each output stays, as the manifest says: only token ids come back, the rest stays on the GPU
    const preferredOutputLocation = Object.fromEntries(
      graph.outputs.map((o) => [o.name, o.location === 'gpu' ? 'gpu-buffer' : 'cpu']));
    try {
      const session = await ort.InferenceSession.create(model, {
        executionProviders: [this.backend],
        graphOptimizationLevel: 'all',
        externalData,
        ...(this.backend === 'webgpu' ? { preferredOutputLocation } : {}),
      });
      this.watchDevice();
      this.releaseWeights(graph.weights);
      return session;
    } catch (e) {
      throw new PageError(`could not open ${graph.file} on ${this.backend}: ${e.message}`);
    }
  }

  /** Drops the bytes of those weights files that no graph still to open reads: each session holds its own
   * copy of what it read (the base's 540 MB of SmolLM2 would otherwise stay in the page twice). */
  releaseWeights(paths) {
    const pending = Object.keys(this.graphs).filter((name) => !this.sessions[name]);
    for (const path of paths) {
      if (!pending.some((name) => this.graphs[name].weights.includes(path))) delete this.weights[path];
    }
  }

  /**
   * The base graph's adapter inputs for a task (manifest.adapters): its adapter's tensors (downloaded once, checked
   * against the manifest), each transposed and scaled as the manifest says, or zeros (the base alone) for a task
   * without one; {} for a graph without adapter inputs. On WebGPU they are uploaded once, kept on the GPU, and
   * fed to every run as they are: switching features changes these inputs, never the base's session.
   * @param {string|null} task
   * @returns {Promise<Object<string, ort.Tensor>>}
   */
  adapterFeeds(task) {
    const spec = this.manifest.adapters;
    if (!spec) return Promise.resolve({});
    const key = spec.by_task[task] ? task : null;
    return (this.adapters[key] ??= this.loadAdapter(key));
  }

  async loadAdapter(task) {
    const spec = this.manifest.adapters;
    const file = task && spec.by_task[task];
    const state = file ? safetensors(await this.fetch(file, () => () => {})) : null;
    const shapes = Object.fromEntries(this.graphs.base.inputs.map((i) => [i.name, i.shape]));
    const f16 = this.dtype === 'float16';
    if (f16 && typeof Float16Array === 'undefined') throw new PageError('this browser lacks Float16Array: use ?precision=fp32');
    if (this.backend === 'webgpu') await this.open(['base']);  // the device onnxruntime-web creates with it
    const feeds = {};
    for (const [name, [key, scale]] of Object.entries(spec.inputs)) {
      const [rows, cols] = shapes[name];  // the input: the file's (cols, rows) tensor transposed
      const out = f16 ? new Float16Array(rows * cols) : new Float32Array(rows * cols);
      if (state) {
        const t = state[key];
        if (!t || t.dtype !== 'F16' || t.shape[0] !== cols || t.shape[1] !== rows) {
          throw new PageError(`${file}: ${key} is missing or not an F16 [${cols}, ${rows}] tensor: rebuild the site`);
        }
        for (let r = 0; r < rows; r += 1) for (let c = 0; c < cols; c += 1) out[r * cols + c] = half(t.data[c * rows + r]) * scale;
      }
      feeds[name] = this.backend === 'webgpu' ? this.gpuTensor(out, this.dtype, [rows, cols])
        : new ort.Tensor(this.dtype, f16 ? new Uint16Array(out.buffer) : out, [rows, cols]);
    }
    return feeds;
  }

  /** A tensor uploaded to a buffer of onnxruntime-web's WebGPU device, kept there for the page's life. */
  gpuTensor(values, dataType, dims) {
    const device = ort.env.webgpu.device;
    // eslint-disable-next-line no-undef
    const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
    const buffer = device.createBuffer({ size: Math.ceil(values.byteLength / 16) * 16, usage });
    device.queue.writeBuffer(buffer, 0, values.buffer, values.byteOffset, values.byteLength);
    return ort.Tensor.fromGpuBuffer(buffer, { dataType, dims, dispose: () => buffer.destroy() });
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
