// The benchmark's wllama peer: llama.cpp's server context compiled to WebAssembly (@wllama/wllama), on
// the same GGUF file as the page's base, greedy, fed token ids, timed in the page as the page times itself.
// builder/bench/peers.py serves this file next to ./wllama/ (a copy of the package's esm/ folder) and
// ./model.gguf; nothing here is fetched from any other origin.
//
//   await peer.load({ n_threads: 1 | 'max', verbose? })  -> { libllama, threads, multithread, crossOriginIsolated, ... }
//   await peer.generate(promptIds, nPredict)   -> { ids, prefill_ms, decode_ms, tokens_per_s, timings, ... }
//
// Token ids in: wllama 3.8.1's completion takes the prompt as a string only (its C++ keeps it as
// `cli_prompt`, a std::string; a token array is refused). So the page turns the ids back into the exact
// text from the GGUF's own vocabulary (byte-level BPE: each token's bytes; control tokens such as
// <|im_start|> as their text, which llama.cpp parses back as special tokens, BOS not added since
// tokenizer.ggml.add_bos_token is false), and checks that llama.cpp read back as many tokens as it was given.
import { Wllama } from './wllama/index.js';

const quiet = { debug() {}, log() {}, warn: console.warn, error: console.error };
let wllama = null;
let vocab = null;  // token id -> its bytes

/** GPT-2's byte-level alphabet: the character that stands for each byte in a token's text, reversed. */
function byteDecoder() {
  const bs = [];
  for (let b = 33; b <= 126; b++) bs.push(b);
  for (let b = 161; b <= 172; b++) bs.push(b);
  for (let b = 174; b <= 255; b++) bs.push(b);
  const cs = [...bs];
  for (let b = 0, n = 0; b < 256; b++) if (!bs.includes(b)) { bs.push(b); cs.push(256 + n++); }
  return new Map(cs.map((c, i) => [String.fromCodePoint(c), bs[i]]));
}

/** tokenizer.ggml.tokens of a GGUF file (its header and key-values come before the tensors). */
async function ggufTokens(blob) {
  const buf = await blob.slice(0, Math.min(blob.size, 16 << 20)).arrayBuffer();
  const view = new DataView(buf), text = new TextDecoder();
  let at = 0;
  const u32 = () => { const v = view.getUint32(at, true); at += 4; return v; };
  const u64 = () => { const v = Number(view.getBigUint64(at, true)); at += 8; return v; };
  const str = () => { const n = u64(); at += n; return text.decode(new Uint8Array(buf, at - n, n)); };
  const SIZE = { 0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8 };
  const skip = (type) => {
    if (type === 8) { const n = u64(); at += n; return; }
    if (type === 9) { const t = u32(), n = u64(); if (SIZE[t]) at += n * SIZE[t]; else for (let i = 0; i < n; i++) skip(t); return; }
    at += SIZE[type];
  };
  if (u32() !== 0x46554747) throw new Error('not a GGUF file');
  u32(); u64();  // version, tensor count
  for (let kv = u64(); kv > 0; kv--) {
    const key = str(), type = u32();
    if (key === 'tokenizer.ggml.tokens') {
      if (type !== 9 || u32() !== 8) throw new Error('tokenizer.ggml.tokens is not an array of strings');
      const out = [];
      for (let n = u64(); n > 0; n--) out.push(str());
      return out;
    }
    skip(type);
  }
  throw new Error('the GGUF file has no tokenizer.ggml.tokens');
}

/** The text whose llama.cpp tokenization is ids: the tokens' bytes, end to end, read as UTF-8. */
export function detokenize(ids) {
  const bytes = [];
  for (const id of ids) {
    if (!(id >= 0 && id < vocab.length)) throw new Error(`token id ${id} is not in the vocabulary (${vocab.length})`);
    bytes.push(...vocab[id]);
  }
  return new TextDecoder('utf-8', { fatal: true }).decode(new Uint8Array(bytes));
}

/** The most WASM threads the project's page would use here (web/src/runtime.mjs: one per core, at most 4). */
export function maxThreads() {
  return globalThis.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
}

async function load({ n_threads = 'max', model = './model.gguf', n_ctx = 2048, verbose = false } = {}) {
  if (wllama) await wllama.exit();
  const threads = n_threads === 'max' ? maxThreads() : n_threads;
  const response = await fetch(model);
  if (!response.ok) throw new Error(`cannot fetch ${model}: HTTP ${response.status}`);
  const blob = await response.blob();
  const decoder = byteDecoder();
  vocab = (await ggufTokens(blob)).map((t) => Uint8Array.from([...t], (c) => decoder.get(c) ?? c.codePointAt(0)));
  wllama = new Wllama({ default: new URL('./wllama/wasm/wllama.wasm', import.meta.url).href },
    verbose ? {} : { suppressNativeLog: true, logger: quiet });
  // n_gpu_layers 0: WASM on the CPU (wllama would otherwise offload every layer to WebGPU);
  // one slot, no prompt cache reuse between requests (every prompt is prefilled in full)
  await wllama.loadModel([blob], { n_threads: threads, n_gpu_layers: 0, n_ctx, n_parallel: 1, n_cache_reuse: 0 });
  const info = {
    libllama: Wllama.getLibllamaVersion(), threads: wllama.getNumThreads(), threads_requested: threads,
    multithread: wllama.isMultithread(), crossOriginIsolated: globalThis.crossOriginIsolated,
    hardwareConcurrency: navigator.hardwareConcurrency, model_bytes: blob.size, eog: wllama.getLoadedContextInfo().list_tokens_eog,
  };
  document.getElementById('status').textContent = `wllama ready: ${info.threads} thread(s)`;
  return info;
}

/**
 * Greedy decoding of nPredict new tokens after promptIds (token ids, as given: no BOS added). Timed at
 * the stream: prefill_ms is the call until the first new token arrives, decode_ms from there to the last;
 * tokens_per_s = (new tokens - 1) / decode seconds.
 * `timings` is llama.cpp's own account (prompt_ms, predicted_ms, ...), for comparison.
 */
async function generate(promptIds, nPredict) {
  if (!wllama) throw new Error('peer.load() first');
  const prompt = detokenize(promptIds);
  const ids = [];
  let first = null, last = null, timings = null, promptTokens = null;
  const t0 = performance.now();
  await wllama.createCompletion({
    prompt, max_tokens: nPredict, stream: true, cache_prompt: false,
    // greedy: temperature 0 keeps only the top logit; the samplers that could change it are off
    temperature: 0, top_k: 1, top_p: 1, min_p: 0, typ_p: 1, penalty_repeat: 1, penalty_freq: 0,
    penalty_present: 0, dry_multiplier: 0, xtc_probability: 0, mirostat: 0,
    // each chunk then names its token id (logprobs.content[0].id); post-sampling: the one candidate top_k
    // leaves, not a softmax and sort of the whole vocabulary per token, which would weigh on the timing
    n_probs: 1, post_sampling_probs: true,
    onData: (chunk) => {
      const now = performance.now();
      for (const c of chunk.choices?.[0]?.logprobs?.content ?? []) ids.push(c.id);
      if (chunk.choices?.[0]?.logprobs?.content?.length) { first ??= now; last = now; }
      if (chunk.timings) timings = chunk.timings;
      if (chunk.usage) promptTokens = chunk.usage.prompt_tokens;
    },
  });
  const end = performance.now();
  if (promptTokens !== promptIds.length) {
    throw new Error(`llama.cpp read ${promptTokens} prompt tokens where it was given ${promptIds.length}`);
  }
  first ??= end; last ??= end;
  const decode_ms = last - first;
  return { ids, prompt_tokens: promptTokens, prefill_ms: first - t0, decode_ms, total_ms: end - t0,
    tokens_per_s: ids.length > 1 && decode_ms > 0 ? (ids.length - 1) / (decode_ms / 1000) : null, timings };
}

window.peer = { load, generate, maxThreads, detokenize };
