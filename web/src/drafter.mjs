// The independent drafter as a draft source, as builder/decode/drafter.py: a small language model of its own
// that reads only tokens. It keeps the cache of the longest prefix of the context it has already read
// (accepted drafts included), so each step it reads only the tokens decided since, then drafts greedily,
// one token per run. The model is run through three functions (onnx_backend.mjs gives them):
//   forward(ids, cache) -> [greedy token after the last id, new cache]   cache null: nothing read yet
//   trim(cache, n) -> the cache of the first n positions (a prefix view)
//   release(cache) -> disposes the GPU tensors a run returned (a cache a later run replaced)

export class IndependentDrafter {
  constructor(forward, trim, release) {
    this.forward = forward;
    this.trim = trim;
    this.release = release;
    this.ids = [];  // the tokens whose keys and values are in this.cache, in order
    this.cache = null;
  }

  /** k greedy drafts after context (the sequence so far, its last token decided but not yet read). */
  async draft(context, k) {
    let keep = 0;
    while (keep < Math.min(this.ids.length, context.length - 1) && this.ids[keep] === context[keep]) keep += 1;
    let cache = keep ? this.trim(this.cache, keep) : null;
    let owned = this.cache;  // the tensors behind cache: disposed once a run has read them
    let [ids, feed] = [context.slice(0, keep), context.slice(keep)];
    const drafts = [];
    for (let i = 0; i < k; i += 1) {
      const [token, next] = await this.forward(feed, cache);
      this.release(owned);
      cache = owned = next;
      ids = ids.concat(feed);
      feed = [token];
      drafts.push(token);
    }
    [this.ids, this.cache] = [ids, cache];  // the last draft is not read: the next context decides it
    return drafts;
  }

  /** Disposes the cache (the decode is over). */
  close() {
    this.release(this.cache);
    [this.ids, this.cache] = [[], null];
  }
}
