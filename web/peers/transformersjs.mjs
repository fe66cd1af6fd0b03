// The benchmark's transformers.js peer: @huggingface/transformers running a local ONNX export of SmolLM2
// (builder/bench/hf_onnx.py: fp32, the same values as the PyTorch reference, and its 8-bit and 4-bit
// quantizations, dtype q8 and q4, as transformers.js users load on WASM) on onnxruntime-web's WASM
// backend, greedy, fed token ids, timed in the page as the page times itself.
// builder/bench/transformersjs.py serves this file next to ./transformers/ (the package's self-contained
// browser build and the onnxruntime-web WebAssembly binary it was built with) and ./models/smollm2/;
// nothing is fetched from any other origin (no hub, no CDN).
//
//   await peer.load({ n_threads: 1 | 'max', dtype: 'fp32' | 'q8' | 'q4' })  -> { version, onnxruntime, threads, crossOriginIsolated, ... }
//   await peer.generate(promptIds, nPredict)   -> { ids, prompt_tokens, prefill_ms, decode_ms, tokens_per_s, ... }
import { AutoModelForCausalLM, BaseStreamer, Tensor, env, ones } from './transformers/transformers.js';

const MODEL = 'smollm2';
let model = null;

/** The most WASM threads the project's page would use here (web/src/runtime.mjs: one per core, at most 4). */
export function maxThreads() {
  return globalThis.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
}

/** Records when each new token arrives: generate() first puts the prompt, then each new token. */
class Clock extends BaseStreamer {
  constructor() {
    super();
    this.prompt = null;
    this.ids = [];
    this.first = null;
    this.last = null;
  }

  put(value) {
    const now = performance.now();
    if (this.prompt === null) { this.prompt = value[0].length; return; }
    this.ids.push(Number(value[0][0]));
    this.first ??= now;
    this.last = now;
  }

  end() {}
}

async function load({ n_threads = 'max', dtype = 'fp32' } = {}) {
  if (model) throw new Error('peer.load() once per page: onnxruntime-web starts its WASM threads once');
  const threads = n_threads === 'max' ? maxThreads() : n_threads;
  env.allowRemoteModels = false;
  env.allowLocalModels = true;
  env.localModelPath = new URL('./models/', import.meta.url).href;
  env.useBrowserCache = false;  // no Cache Storage copy of the weights: every load reads the served files
  env.useWasmCache = false;
  const wasm = env.backends.onnx.wasm;
  // transformers.js's default build (asyncify), from this origin rather than its CDN default
  wasm.wasmPaths = { wasm: new URL('./transformers/ort-wasm-simd-threaded.asyncify.wasm', import.meta.url).href };
  wasm.numThreads = threads;
  wasm.proxy = false;
  model = await AutoModelForCausalLM.from_pretrained(MODEL, { device: 'wasm', dtype });
  const info = {
    version: env.version, onnxruntime: env.backends.onnx.versions?.web ?? null, device: 'wasm', dtype,
    threads: wasm.numThreads, threads_requested: threads, crossOriginIsolated: globalThis.crossOriginIsolated,
    hardwareConcurrency: navigator.hardwareConcurrency, inputs: model.sessions.model.inputNames.length,
    eos: model.generation_config?.eos_token_id ?? model.config.eos_token_id,
  };
  document.getElementById('status').textContent = `transformers.js ready: ${dtype}, ${info.threads} thread(s)`;
  return info;
}

/**
 * Greedy decoding of up to nPredict new tokens after promptIds (token ids, as given: no BOS added; the end
 * token stops it). Timed at the streamer: prefill_ms is the call until the first new token, decode_ms
 * from there to the last; tokens_per_s = (new tokens - 1) / decode seconds.
 */
async function generate(promptIds, nPredict) {
  if (!model) throw new Error('peer.load() first');
  const input_ids = new Tensor('int64', BigInt64Array.from(promptIds, BigInt), [1, promptIds.length]);
  const clock = new Clock();
  const t0 = performance.now();
  await model.generate({
    input_ids, attention_mask: ones([1, promptIds.length]), max_new_tokens: nPredict, do_sample: false,
    num_beams: 1, repetition_penalty: 1.0, streamer: clock,
  });
  const end = performance.now();
  if (clock.prompt !== promptIds.length) {
    throw new Error(`transformers.js read ${clock.prompt} prompt tokens where it was given ${promptIds.length}`);
  }
  const first = clock.first ?? end, last = clock.last ?? end;
  const decode_ms = last - first;
  const ids = clock.ids;
  return { ids, prompt_tokens: clock.prompt, prefill_ms: first - t0, decode_ms, total_ms: end - t0,
    tokens_per_s: ids.length > 1 && decode_ms > 0 ? (ids.length - 1) / (decode_ms / 1000) : null, timings: null };
}

window.peer = { load, generate, maxThreads };
