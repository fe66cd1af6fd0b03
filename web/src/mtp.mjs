// Frozen MTP in the browser: the models, the tokenizer and the one decode loop, with onnxruntime-web.
//
// Everything about the graphs (input and output names, KV layout, K, the head's KV layer, special
// tokens, task formats) comes from models/manifest.json, written by `python -m builder build`.
//
// The decode loop mirrors builder/generate.py's `decode`: prefill reads prompt[:-1]; each step the head
// drafts k tokens in one run, the base verifies [token, d_1..d_k] in one run, the longest agreeing prefix
// plus the base's own next token is decided, and the KV cache is rolled back to the kept positions by a
// prefix view of the same buffer. On WebGPU the KV cache and the hidden states stay on the GPU
// ('gpu-buffer' outputs) and are fed as they are to the head and to the next base run; only token ids
// (the base's greedy choices, argmax taken inside the graph, and the head's drafts) are read back.

import * as ort from './vendor/ort/ort.webgpu.min.mjs';
import { Tokenizer } from './vendor/tokenizers/tokenizers.min.mjs';

ort.env.wasm.wasmPaths = new URL('./vendor/ort/', import.meta.url).href;
ort.env.logLevel = 'error';

/** An error a visitor can act on; `message` is one plain sentence. */
export class PageError extends Error {}

/** The WebGPU device was lost (driver reset, GPU process crash, device destroyed): its sessions are gone. */
export class DeviceLostError extends PageError {}

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
 * no fp16 ones: half the download, not faster. The site may lack fp16 graphs: Runtime.load then uses fp32.
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

/** Fetches a file of the site, reporting bytes as they arrive; checks its sha256 when one is given. */
async function fetchBytes(url, { sha256, bytes, onBytes }) {
  let response;
  try {
    response = await fetch(url);
  } catch (e) {
    throw new PageError(`could not download ${url} (${e.message})`);
  }
  if (response.status === 404) throw new PageError(`${url} is missing from the site (HTTP 404): rebuild the site`);
  if (!response.ok) throw new PageError(`could not download ${url}: HTTP ${response.status} ${response.statusText}`);
  const reader = response.body.getReader();
  const chunks = [];
  let got = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    chunks.push(value);
    got += value.length;
    onBytes?.(value.length);
  }
  const data = new Uint8Array(got);
  let at = 0;
  for (const c of chunks) { data.set(c, at); at += c.length; }
  if (sha256) {
    const digest = hex(await crypto.subtle.digest('SHA-256', data));
    if (digest !== sha256) {
      throw new PageError(`${url} is altered or truncated: ${got} bytes with sha256 ${digest.slice(0, 16)}.., ` +
        `the manifest says ${bytes} bytes with sha256 ${sha256.slice(0, 16)}..`);
    }
  }
  return data;
}

const hex = (buffer) => [...new Uint8Array(buffer)].map((b) => b.toString(16).padStart(2, '0')).join('');

/** A short description of a tensor for error messages and the trace. */
function describe(t, bufferId) {
  const d = { dtype: t.type, dims: [...t.dims], location: t.location };
  if (t.location === 'gpu-buffer') d.buffer = bufferId(t.gpuBuffer);
  return d;
}

/**
 * The loaded models: the base and head sessions, the manifest and the tokenizer.
 * Create with `Runtime.load`; `decode` runs one generation.
 */
export class Runtime {
  constructor(manifest, tokenizer, modelsUrl, backend, precision, onProgress) {
    this.manifest = manifest;
    this.tokenizer = tokenizer;
    this.modelsUrl = modelsUrl;
    this.backend = backend;          // 'webgpu' | 'wasm'
    this.precision = precision;      // 'fp32' | 'fp16': which files of each graph run (graph or graph.fp16)
    // the float type of the graphs' float inputs (the empty caches of a prefill)
    this.float = precision === 'fp16' ? ['float16', Uint16Array] : ['float32', Float32Array];
    this.onProgress = onProgress;
    this.sessions = {};              // graph name -> Promise of its session, opened on first use
    this.context = manifest.context_length;
    this.kMax = manifest.head.k;
    this.eos = manifest.eos_token_id;
    this.special = new Set(Object.values(manifest.special_tokens));
    const kv = manifest.kv;
    this.kvDims = kv.shape.slice(2);                    // [n_kv, head_dim]
    this.pastNames = kv.past_inputs;                    // past_key_0, past_value_0, ..
    this.presentToPast = Object.fromEntries(kv.present_outputs.map((p, i) => [p, kv.past_inputs[i]]));
    // head input -> the cache entry (past name) it reads: the base's present of the head's KV layer
    this.headKv = Object.fromEntries(Object.entries(manifest.head.kv_inputs).map(([inp, out]) => [inp, this.presentToPast[out]]));
    const dk = manifest.drafter?.kv;
    this.drafterPresentToPast = dk ? Object.fromEntries(dk.present_outputs.map((p, i) => [p, dk.past_inputs[i]])) : null;
    this.drafterState = null;        // the independent drafter's own cache: {ids, cache, owners}
    this.queue = Promise.resolve();  // every session.run goes through this one chain
    this.trace = null;               // set to [] to record every run's inputs and outputs
    this.bufferIds = new WeakMap();
    this.gpuTensors = new Set();     // every GPU tensor a run returned and nobody disposed yet
    this.watched = null;             // the WebGPU device watched for loss (WebGPU only)
    this.lost = null;                // once the WebGPU device is lost: its GPUDeviceLostInfo
    this.onLost = null;              // called once, with that info
  }

  /** Watches the WebGPU device onnxruntime-web created (with the first session) for loss. */
  watchDevice() {
    const device = ort.env.webgpu?.device;
    if (this.backend !== 'webgpu' || this.watched || !device?.lost) return;
    this.watched = device;
    device.lost.then((info) => {
      this.lost = info;
      this.onLost?.(info);
    });
  }

  /** Whether the device is lost, waiting a moment for its lost promise when a run has just failed. */
  async deviceLost() {
    if (this.lost || !this.watched) return this.lost;
    await Promise.race([this.watched.lost, new Promise((resolve) => { setTimeout(resolve, 200); })]);
    return this.lost;
  }

  /** Disposes a tensor a run returned (a no-op for CPU tensors) and stops counting it. */
  dispose(t) {
    if (this.gpuTensors.delete(t)) t.dispose();
  }

  /**
   * Reads the manifest and the tokenizer under `modelsUrl` (the models/ folder's URL), then opens the
   * graphs named in `open` (the rest open when first used).
   * @param {string} modelsUrl
   * With precision 'fp16' it runs each graph's fp16 variant; a site without them runs fp32 (see .precision).
   * @param {{backend: string, precision: string, open: (manifest) => string[], onProgress?: (loaded: number, total: number, file: string) => void}} options
   */
  static async load(modelsUrl, { backend, precision = 'fp32', open, onProgress }) {
    const manifestUrl = new URL('manifest.json', modelsUrl);
    const manifest = JSON.parse(new TextDecoder().decode(await fetchBytes(manifestUrl, {})));
    if (manifest.format !== 'frozen-mtp-onnx/1') {
      throw new PageError(`${manifestUrl} is not a frozen-mtp-onnx/1 manifest (format ${manifest.format})`);
    }
    const json = JSON.parse(new TextDecoder().decode(await fetchBytes(new URL(manifest.tokenizer, modelsUrl), {})));
    // Special tokens are encoded by id, never parsed out of the user's text (builder/tasks.py): the JS
    // tokenizer gets no added tokens, so "<|fix|>" typed by a user stays text.
    const tokenizer = new Tokenizer({ ...json, added_tokens: [] }, {});
    const hasFp16 = Object.values(manifest.graphs).every((g) => g.fp16);
    const runtime = new Runtime(manifest, tokenizer, modelsUrl, backend, hasFp16 ? precision : 'fp32', onProgress);
    await runtime.openAll(open(manifest));
    return runtime;
  }

  /** A graph's file, inputs and outputs in the precision in use. */
  graph(name) {
    const graph = this.manifest.graphs[name];
    if (!graph) throw new PageError(`the manifest has no graph "${name}"`);
    return this.precision === 'fp16' ? graph.fp16 : graph;
  }

  /** The head graph that drafts exactly k tokens. */
  headGraph(k) {
    return this.manifest.head.by_k[String(k)];
  }

  /** Opens graphs one at a time (DESIGN.md), with one progress bar over their files. */
  async openAll(names) {
    const todo = names.filter((n) => !this.sessions[n]);
    const total = todo.reduce((s, n) => s + this.manifest.files[this.graph(n).file].bytes, 0);
    let loaded = 0;
    for (const name of todo) {
      this.sessions[name] = this.create(name, (n, file) => { loaded += n; this.onProgress?.(loaded, total, file); });
      await this.sessions[name];
    }
  }

  /** Downloads a graph with progress, checks it against the manifest's sha256, creates its session. */
  async create(name, onBytes) {
    const graph = this.graph(name);
    const info = this.manifest.files[graph.file];
    const data = await fetchBytes(new URL(graph.file, this.modelsUrl), { ...info, onBytes: (n) => onBytes(n, graph.file) });
    const preferredOutputLocation = {};
    for (const out of graph.outputs) {
      // only token ids come back: every float output stays where it was computed
      preferredOutputLocation[out.name] = this.backend === 'webgpu' && out.dtype !== 'int64' ? 'gpu-buffer' : 'cpu';
    }
    try {
      const session = await ort.InferenceSession.create(data, {
        executionProviders: [this.backend],
        graphOptimizationLevel: 'all',
        ...(this.backend === 'webgpu' ? { preferredOutputLocation } : {}),
      });
      this.watchDevice();
      return session;
    } catch (e) {
      throw new PageError(`could not open ${graph.file} on ${this.backend}: ${e.message}`);
    }
  }

  /** The ids of plain text (no special tokens recognised in it). */
  encodeText(text) {
    // a lone surrogate (half a UTF-16 pair) becomes U+FFFD, as builder/tasks.py's well_formed
    return text ? this.tokenizer.encode(text.toWellFormed(), { add_special_tokens: false }).ids : [];
  }

  /** The prompt's ids in the task's one format: prefix + text + suffix (builder/tasks.py). */
  encodePrompt(task, text) {
    const format = this.manifest.tasks[task];
    if (!format) throw new PageError(`unknown task "${task}": choose ${Object.keys(this.manifest.tasks).join(' or ')}`);
    if (typeof text !== 'string') throw new PageError(`the prompt must be text, got ${typeof text}`);
    if (!text.trim()) throw new PageError('the prompt is empty');
    return [...format.prefix, ...this.encodeText(text), ...format.suffix];
  }

  /** An empty cache tensor (S = 0) of the given [n_kv, head_dim], in the graphs' float type. */
  emptyCache(dims) {
    const [type, Array] = this.float;
    return new ort.Tensor(type, new Array(0), [1, 0, ...dims]);
  }

  /** Text of new ids, special tokens skipped (as Python's decode). */
  decodeText(ids) {
    const text = ids.filter((id) => !this.special.has(id));
    return text.length ? this.tokenizer.decode(text) : '';  // tokenizers.js refuses an empty list
  }

  /** A stable number for a GPUBuffer, so a trace shows which run's output another run reads. */
  bufferId(buffer) {
    let id = this.bufferIds.get(buffer);
    if (id === undefined) {
      this.bufferCount = (this.bufferCount || 0) + 1;
      id = this.bufferCount;
      this.bufferIds.set(buffer, id);
    }
    return id;
  }

  /** Runs a graph through the one promise chain; a failure names every input. */
  run(graph, feeds) {
    const result = this.queue.then(async () => {
      if (!this.sessions[graph]) await this.openAll([graph]);
      const session = await this.sessions[graph];
      let outputs;
      if (this.lost) throw new DeviceLostError(`the GPU device was lost (${this.lost.reason}: ${this.lost.message})`);
      try {
        outputs = await session.run(feeds);
      } catch (e) {
        const lost = await this.deviceLost();
        if (lost) throw new DeviceLostError(`the GPU device was lost (${lost.reason}: ${lost.message})`);
        const inputs = Object.entries(feeds).map(([n, t]) => `${n} ${t.type}[${t.dims}] on ${t.location}`).join(', ');
        throw new PageError(`${graph} graph failed on ${this.backend} (${e.message}); inputs: ${inputs}`);
      }
      for (const t of Object.values(outputs)) if (t.location === 'gpu-buffer') this.gpuTensors.add(t);
      if (this.trace) {
        const id = (b) => this.bufferId(b);
        this.trace.push({
          graph,
          inputs: Object.fromEntries(Object.entries(feeds).map(([n, t]) => [n, describe(t, id)])),
          outputs: Object.fromEntries(Object.entries(outputs).map(([n, t]) => [n, describe(t, id)])),
        });
      }
      return outputs;
    });
    this.queue = result.catch(() => {});
    return result;
  }

  /** A view of the first n positions of a KV tensor (1, S, n_kv, head_dim): same buffer, no copy. */
  prefix(t, n) {
    const dims = [1, n, ...t.dims.slice(2)];
    if (t.dims[1] === n) return t;
    if (t.location === 'gpu-buffer') return ort.Tensor.fromGpuBuffer(t.gpuBuffer, { dataType: t.type, dims });
    return new ort.Tensor(t.type, t.data.subarray(0, n * t.dims[2] * t.dims[3]), dims);
  }

  /** Runs the base on ids after the state's cache; returns the choices and a state owning the new tensors. */
  async base(state, ids) {
    const feeds = { input_ids: new ort.Tensor('int64', BigInt64Array.from(ids, BigInt), [1, ids.length]), ...state.cache };
    const out = await this.run('base', feeds);
    const choices = Array.from(out.choices.data, Number);
    const cache = {};
    for (const [present, past] of Object.entries(this.presentToPast)) cache[past] = out[present];
    this.dispose(out.margins);  // never read: the exactness rule's margins are the Python reference's
    return { choices, state: { cache, hidden: out.hidden, fed: ids.length, owners: Object.values(cache).concat(out.hidden) } };
  }

  prefill(ids) {
    const empty = this.emptyCache(this.kvDims);  // S = 0: no past yet
    return this.base({ cache: Object.fromEntries(this.pastNames.map((n) => [n, empty])) }, ids);
  }

  /** Keeps the first nFed of the tokens just verified: prefix views of the owners' buffers. */
  rollback(state, nFed) {
    const drop = state.fed - nFed;
    if (drop === 0) return state;
    const cache = {};
    for (const [name, t] of Object.entries(state.cache)) cache[name] = this.prefix(t, t.dims[1] - drop);
    return { ...state, cache, fed: nFed };
  }

  /**
   * The head's k drafts after the state's anchor (its last kept position), `token` decided there, from
   * the head graph of kGraph >= k drafts (the user's k: near the end of a generation fewer are needed,
   * and the longer chain's first k are the same drafts, without opening another graph).
   */
  async draft(state, token, k, kGraph = k) {
    const feeds = {
      hidden: state.hidden,  // the base's hidden output as it is; the anchor indexes it
      anchor: new ort.Tensor('int64', BigInt64Array.from([BigInt(state.fed - 1)]), [1]),
      token: new ort.Tensor('int64', BigInt64Array.from([BigInt(token)]), [1, 1]),
    };
    for (const [input, past] of Object.entries(this.headKv)) feeds[input] = state.cache[past];
    const out = await this.run(this.headGraph(kGraph), feeds);
    return Array.from(out.drafts.data.subarray(0, k), Number);
  }

  /**
   * The independent drafter's k greedy drafts after context (the sequence so far; its last token is
   * decided but not yet read). Like builder/drafter.py: it keeps its own cache of the longest prefix of
   * the context it has read, reads the tokens decided since, then one run per draft.
   */
  async drafterDraft(context, k) {
    const d = this.drafterState || { ids: [], cache: null, owners: [] };
    let keep = 0;
    const limit = Math.min(d.ids.length, context.length - 1);
    while (keep < limit && d.ids[keep] === context[keep]) keep += 1;
    const kv = this.manifest.drafter.kv;
    let cache = {};
    if (keep) {
      for (const [name, t] of Object.entries(d.cache)) cache[name] = this.prefix(t, keep);
    } else {
      const empty = this.emptyCache(kv.shape.slice(2));
      for (const name of kv.past_inputs) cache[name] = empty;
    }
    let { owners } = d;
    let ids = context.slice(0, keep);
    let feed = context.slice(keep);
    const drafts = [];
    for (let i = 0; i < k; i += 1) {
      const out = await this.run('drafter', { input_ids: new ort.Tensor('int64', BigInt64Array.from(feed, BigInt), [1, feed.length]), ...cache });
      this.dispose(out.margins);
      this.dispose(out.hidden);
      this.release({ owners });  // the new cache replaces the old one
      cache = {};
      for (const [present, past] of Object.entries(this.drafterPresentToPast)) cache[past] = out[present];
      owners = Object.values(cache);
      ids = ids.concat(feed);
      feed = [Number(out.choices.data[out.choices.data.length - 1])];
      drafts.push(feed[0]);
    }
    this.drafterState = { ids, cache, owners };  // the last draft is not read: the next context decides it
    return drafts;
  }

  /** Disposes the GPU tensors a state owns (no-op for CPU tensors). */
  release(state) {
    for (const t of state?.owners || []) this.dispose(t);
  }

  /** Closes every session (the page is done with this runtime, e.g. after its GPU device was lost). */
  async close() {
    for (const t of this.gpuTensors) t.dispose();
    this.gpuTensors.clear();
    for (const pending of Object.values(this.sessions)) {
      try {
        await (await pending).release();
      } catch { /* a session that never opened, or died with its device: nothing to release */ }
    }
    this.sessions = {};
  }

  /**
   * Greedy decoding; with k > 0 a draft source ('head': the MTP head, 'drafter': the independent drafter)
   * drafts k tokens a step and the base verifies them.
   * @param {number[]} promptIds
   * @param {{maxNewTokens: number, k: number, source?: string, onStep?: Function, signal?: AbortSignal}} options
   * Stops at maxNewTokens, at the end-of-sequence token, when the sequence fills the context window, or
   * (checked before every step, so within one step) when signal aborts; `stopped` says which.
   * @returns {Promise<{ids: number[], steps: number, accepted: number[], stopped: string}>}
   */
  async decode(promptIds, { maxNewTokens, k, source = 'head', onStep, signal }) {
    const limit = room(promptIds, maxNewTokens, this.context);
    if (k < 0 || k > this.kMax) throw new PageError(`k must be between 0 and ${this.kMax}, got ${k}`);
    if (k && source === 'drafter' && !this.manifest.graphs.drafter) throw new PageError('this site has no drafter model');
    const out = { ids: [], steps: 0, accepted: [], stopped: 'max-new-tokens' };
    let { state } = await this.prefill(promptIds.slice(0, -1));
    let token = promptIds[promptIds.length - 1];
    try {
      for (;;) {
        if (signal?.aborted) { out.stopped = 'stopped'; return out; }
        // never draft past the limit: that also keeps every fed position inside the context
        const kStep = Math.min(k, limit - out.ids.length - 1);
        let drafts = [];
        if (kStep > 0) {
          drafts = source === 'drafter' ? await this.drafterDraft(promptIds.concat(out.ids), kStep)
            : await this.draft(state, token, kStep, k);
        }
        const verified = await this.base(state, [token, ...drafts]);
        this.release(state);  // the new tensors replace the old ones
        state = verified.state;
        let n = 0;
        while (n < drafts.length && drafts[n] === verified.choices[n]) n += 1;  // the base chose the draft itself
        state = this.rollback(state, n + 1);  // keep [token, d_1..d_n]; the rejected drafts go
        out.steps += 1;
        if (k) out.accepted.push(n);
        const decided = [];
        for (let i = 0; i <= n; i += 1) {
          const id = verified.choices[i];
          out.ids.push(id);
          decided.push({ id, drafted: i < n });
          if (id === this.eos) out.stopped = 'end-of-sequence';
          else if (out.ids.length === limit) out.stopped = limit < maxNewTokens ? 'context-window' : 'max-new-tokens';
          if (id === this.eos || out.ids.length === limit) break;
        }
        onStep?.(decided, out);
        if (out.stopped === 'end-of-sequence' || out.ids.length === limit) return out;
        token = out.ids[out.ids.length - 1];
      }
    } finally {
      this.release(state);
      this.release(this.drafterState);
      this.drafterState = null;
    }
  }
}

/**
 * How many new tokens a decode may produce: maxNewTokens, clamped so that the prompt and its new tokens
 * fit the context window (as builder/generate.py's `room`). A prompt that leaves no room is an error.
 */
export function room(promptIds, maxNewTokens, context) {
  if (promptIds.length < 2) {  // with a marker or BOS first, only a model without either meets this with text
    throw new PageError(promptIds.length ? 'the prompt is a single token: decoding needs at least two, write a little more'
      : 'the prompt is empty');
  }
  if (!Number.isInteger(maxNewTokens) || maxNewTokens < 1) {
    throw new PageError(`max new tokens must be a whole number of at least 1, got ${maxNewTokens}`);
  }
  if (promptIds.length >= context) {
    throw new PageError(`the prompt is ${promptIds.length} tokens, too long for the context window of ${context} ` +
      `tokens: shorten it by at least ${promptIds.length - context + 1} tokens`);
  }
  return Math.min(maxNewTokens, context - promptIds.length);
}
