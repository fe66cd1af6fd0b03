// The decode loop's backend over the ONNX graphs in the page, as builder/decode/onnx_backend.py in Python: it
// satisfies the interface generate.mjs's `decode` drives (`context`, `prefill`, `verify`, `rollback`,
// `draft`). Plain decoding: one base run per step. With the head: two runs per speculative step, the head
// graph of the user's k (`head.by_k[k]`; when fewer drafts are allowed near the end of a generation, the
// first k_step of its drafts, as Python does) and the base verifying [token, drafts]. With the drafter:
// its own cache, one drafter run per draft (drafter.mjs).
//
// A prompt is read in chunks of PREFILL_CHUNK tokens, each after the cache of those before it (the base graph's
// past input, as a verify reads its drafts): the attention's scores are heads x chunk x (past + chunk), not
// heads x T x T (2.4 GB for SmolLM2 at T = 8190, beyond the WASM heap and WebGPU's buffer limits). The
// drafter reads a prompt in the same chunks.
//
// On WebGPU the KV cache, the hidden states and the embeddings of the base's choices stay on the GPU
// ('gpu-buffer' outputs) and are fed as they are to the head and to the next base run; rollback is a prefix view of the same buffer, never a copy;
// only token ids are read back (and the head's confidences, where the decode cuts drafts by them). The tensors a run returned are disposed once a later run replaced them,
// and by `close` at the end of the decode.

import { IndependentDrafter } from './drafter.mjs';
import { ort } from './runtime.mjs';  // the onnxruntime-web build the page loaded

export const PREFILL_CHUNK = 256;

const int64 = (ids, dims = [1, ids.length]) => new ort.Tensor('int64', BigInt64Array.from(ids, BigInt), dims);
const mapValues = (object, f) => Object.fromEntries(Object.entries(object).map(([name, t]) => [name, f(t)]));

/** A view of the first n positions (axis 1) of a tensor (1, S, ...): the same buffer, no copy. */
function prefix(t, n) {
  if (t.dims[1] === n) return t;
  const dims = [1, n, ...t.dims.slice(2)];
  if (t.location === 'gpu-buffer') return ort.Tensor.fromGpuBuffer(t.gpuBuffer, { dataType: t.type, dims });
  return new ort.Tensor(t.type, t.data.subarray(0, dims.reduce((a, b) => a * b)), dims);
}

/** The cache of nothing read yet (S = 0) for a KV spec of the manifest, in the float type `dtype`. */
function emptyCache(kv, dtype) {
  const empty = new ort.Tensor(dtype, dtype === 'float16' ? new Uint16Array(0) : new Float32Array(0),
    [1, 0, ...kv.shape.slice(2)]);
  return Object.fromEntries(kv.past_inputs.map((name) => [name, empty]));
}

/** The cache a run returned, by the past input names it feeds next: present_key_0 -> past_key_0, .. */
const cacheOf = (out, kv) => Object.fromEntries(kv.present_outputs.map((name, i) => [kv.past_inputs[i], out[name]]));

export class OnnxBackend {
  /**
   * @param {import('./sessions.mjs').Sessions} sessions  the page's sessions (sessions.mjs)
   * @param {{source?: 'head'|'drafter'|null, k?: number, draftCut?: number, adapter?: object, trace?: object[]|null}} options
   *   source: who drafts (null: plain decoding); k: the user's k (the head graph that runs); draftCut: the decode's
   *   cut (generate.mjs), without which the head's confidences stay where they are; adapter: the base graph's adapter
   *   inputs, the feature's (sessions.adapterFeeds); trace: records every run when given
   */
  constructor(sessions, { source = null, k = 0, draftCut = 0, adapter = {}, trace = null } = {}) {
    const m = sessions.manifest;
    this.sessions = sessions;
    this.draftCut = draftCut;
    this.adapter = adapter;
    this.trace = trace;
    this.context = m.context_length;
    this.kv = m.kv;
    this.dtype = sessions.dtype;
    this.head = source === 'head' ? m.head.by_k[String(k)] : null;
    // head input -> the cache entry it reads (the base's present of the head's KV layer, rolled back)
    const pastOf = (present) => m.kv.past_inputs[m.kv.present_outputs.indexOf(present)];
    this.headKv = this.head ? mapValues(m.head.kv_inputs, pastOf) : {};
    this.headEmbeds = !!this.head && sessions.graphs[this.head].inputs.some((i) => i.name === 'embeds');
    this.drafter = source === 'drafter' ? this.independentDrafter(m.drafter.kv) : null;
    this.graphs = ['base', ...(this.head ? [this.head] : []), ...(this.drafter ? ['drafter'] : [])];
    this.owned = [];  // the GPU tensors of the latest state: disposed when the next base run replaces them
  }

  run(graph, feeds) {
    return this.sessions.run(graph, feeds, this.trace);
  }

  /** The base reads ids (S = 0: no past yet), PREFILL_CHUNK at a time, and decides after the last only (the
   * graph's outputs_at). */
  async prefill(ids) {
    let state = { cache: emptyCache(this.kv, this.dtype), ids: [] };
    for (let start = 0; start < ids.length; start += PREFILL_CHUNK) {
      [, state] = await this.verify(state, ids.slice(start, start + PREFILL_CHUNK), true);  // frees the chunk before's cache
    }
    return state;
  }

  /** Runs the base on ids after the state's cache: [its greedy choices after each id (lastOnly: after the
   * last), the state after them]. */
  async verify(state, ids, lastOnly = false) {
    const at = lastOnly ? [ids.length - 1] : ids.map((_, i) => i);
    const out = await this.run('base', { input_ids: int64(ids), outputs_at: int64(at, [at.length]), ...state.cache,
      ...this.adapter });
    this.sessions.dispose(out.margins);  // never read: the exactness rule's margins are the Python reference's
    const cache = cacheOf(out, this.kv);
    this.release();  // the run has read the old state: the new one replaces it
    this.owned = [out.hidden, ...(out.embeds ? [out.embeds] : []), ...Object.values(cache)];
    const choices = Array.from(out.choices.data, Number);
    return [choices, { cache, hidden: out.hidden, embeds: out.embeds, choices, ids: state.ids.concat(ids) }];
  }

  /** Keeps the first nFed of the tokens just verified: prefix views on the sequence axis, no copy. */
  rollback(state, nFed) {
    const drop = state.hidden.dims[1] - nFed;
    if (drop === 0) return state;
    const keep = state.ids.length - drop;
    return { cache: mapValues(state.cache, (t) => prefix(t, keep)), hidden: prefix(state.hidden, nFed),
      embeds: state.embeds && prefix(state.embeds, nFed), choices: state.choices.slice(0, nFed), ids: state.ids.slice(0, keep) };
  }

  async draft(state, token, k) {
    // [drafts, the probability the draft source gives each (null: the drafter gives none)]
    if (this.drafter) return [await this.drafter.draft(state.ids.concat([token]), k), null];
    if (!this.head) throw new Error('this backend has no draft source');
    const feeds = { hidden: state.hidden, anchor: int64([state.hidden.dims[1] - 1], [1]),
      ...mapValues(this.headKv, (past) => state.cache[past]) };
    if (this.headEmbeds) {  // a draft vocabulary: the graph reads the embedding of the base's choice
      // the prompt's last token, not the base's choice: nothing to draft from (as Python, loop.py)
      if (token !== state.choices.at(-1)) return [[], null];
      feeds.embeds = state.embeds;
    } else {
      feeds.token = int64([token], [1, 1]);
    }
    const out = await this.run(this.head, feeds);
    // the confidences are read (on WebGPU, a second read-back of k floats) only where the decode cuts by them
    const sure = this.draftCut ? Array.from((await out.confidence.getData()).subarray(0, k)) : null;
    this.sessions.dispose(out.confidence);
    return [Array.from(out.drafts.data.subarray(0, k), Number), sure];
  }

  /** The drafter graph behind the one drafting logic of drafter.mjs (its own cache, by prefix). */
  independentDrafter(kv) {
    const empty = emptyCache(kv, this.dtype);
    const release = (cache) => Object.values(cache ?? {}).forEach((t) => this.sessions.dispose(t));
    const forward = async (ids, cache) => {  // ids in chunks, as the base's prefill
      let [choice, made] = [0, null];
      for (let start = 0; start < ids.length; start += PREFILL_CHUNK) {
        const chunk = ids.slice(start, start + PREFILL_CHUNK);
        const out = await this.run('drafter', { input_ids: int64(chunk), outputs_at: int64([chunk.length - 1], [1]),
          ...(made ?? cache ?? empty) });
        this.sessions.dispose(out.margins);
        this.sessions.dispose(out.hidden);
        release(made);  // the cache of the chunk before, which this run has read (the caller's is the caller's)
        [choice, made] = [Number(out.choices.data[0]), cacheOf(out, kv)];
      }
      return [choice, made];
    };
    return new IndependentDrafter(forward, (cache, n) => mapValues(cache, (t) => prefix(t, n)), release);
  }

  /** Disposes every GPU tensor this decode still holds (its last state, the drafter's cache). */
  close() {
    this.release();
    this.drafter?.close();
  }

  release() {
    this.owned.forEach((t) => this.sessions.dispose(t));
    this.owned = [];
  }
}
