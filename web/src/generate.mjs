// Greedy decoding, plain and speculative, as one loop over a small backend interface: builder/decode/loop.py's
// `decode`, line for line (its docstring explains the loop). The backend (onnx_backend.mjs) runs the graphs.
// The page's extras: onStep sees the decode after every step (streaming), and an aborted signal stops it
// before the next step (`stopped` is then 'stopped').

import { PageError } from './errors.mjs';

/**
 * How many new tokens a decode may produce: maxNewTokens, clamped so that the prompt and its new tokens
 * fit the context window (as Python's `room`). A prompt that leaves no room is an error.
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

/**
 * Prompt lookup's drafts after ids (the prompt and the tokens decided so far), as Python's `prompt_lookup`: the up
 * to k tokens that followed the latest earlier occurrence of ids' last three tokens; none where those did not occur before.
 */
export function promptLookup(ids, k) {
  const [a, b, c] = ids.slice(-3);
  for (let i = ids.length - 2; i > 1; i -= 1) {
    if (ids[i] === c && ids[i - 1] === b && ids[i - 2] === a) return ids.slice(i + 1, i + 1 + k);
  }
  return [];
}

/**
 * The drafts before the running product of their confidences falls below draftCut (all of them where there is
 * no cut or no confidence), as Python's `cut_drafts`.
 */
export function cutDrafts(drafts, confidence, draftCut) {
  if (!draftCut || !confidence) return drafts;
  let n = 0;
  let sure = 1;
  while (n < drafts.length && sure * confidence[n] >= draftCut) {
    sure *= confidence[n];
    n += 1;
  }
  return drafts.slice(0, n);
}

/**
 * Greedy decoding; with k > 0 the backend drafts k tokens per step (with lookup, prompt lookup first, up to
 * lookupSpan x k: the manifest's lookup_span, Python's LOOKUP_SPAN; with draftCut, only those the draft source is sure
 * enough of: the manifest's draft_cut) and the base verifies them.
 * @param {{context: number, prefill: Function, verify: Function, rollback: Function, draft: Function}} backend
 * @param {number[]} promptIds
 * @param {{maxNewTokens: number, eos: number|null, k?: number, lookup?: boolean, lookupSpan?: number,
 *   draftCut?: number, onStep?: (out: object) => void, signal?: AbortSignal}} options
 * @returns {Promise<{ids: number[], steps: number, accepted: number[], lookups: boolean[], verified: number[],
 *   stopped: string, prefillMs: number}>} verified: per step, the tokens its base pass read (1 + drafts)
 */
export async function decode(backend, promptIds, { maxNewTokens, eos, k = 0, lookup = false, lookupSpan = 1, draftCut = 0, onStep, signal }) {
  const limit = room(promptIds, maxNewTokens, backend.context);
  const out = { ids: [], steps: 0, accepted: [], lookups: [], verified: [], stopped: '', prefillMs: 0 };
  const t0 = performance.now();
  let state = await backend.prefill(promptIds.slice(0, -1));
  out.prefillMs = performance.now() - t0;  // the same base pass in every mode
  let token = promptIds.at(-1);
  while (!signal?.aborted) {
    // never draft past the limit: that also keeps every fed position inside the context
    const left = limit - out.ids.length - 1;
    const kStep = Math.min(k, left);
    let drafts = lookup && kStep > 0 ? promptLookup(promptIds.concat(out.ids), Math.min(lookupSpan * k, left)) : [];
    const lookedUp = drafts.length > 0;
    if (kStep > 0 && !lookedUp) drafts = cutDrafts(...await backend.draft(state, token, kStep), draftCut);
    let choices;
    [choices, state] = await backend.verify(state, [token, ...drafts]);
    let n = 0;
    while (n < drafts.length && drafts[n] === choices[n]) n += 1;  // acceptance: the base chose the draft itself
    state = backend.rollback(state, n + 1);  // keep [token, d_1..d_n]; the rejected drafts go
    out.steps += 1;
    out.verified.push(1 + drafts.length);
    if (k) {
      out.accepted.push(n);
      out.lookups.push(lookedUp);
    }
    for (const tok of choices.slice(0, n + 1)) {
      out.ids.push(tok);
      if (tok === eos || out.ids.length === limit) {
        out.stopped = tok === eos ? 'end-of-sequence' : limit === maxNewTokens ? 'max-new-tokens' : 'context-window';
        break;
      }
    }
    onStep?.(out);
    if (out.stopped) return out;
    token = out.ids.at(-1);
  }
  out.stopped = 'stopped';
  return out;
}

/**
 * CONTRACT.md's acceptance figures of speculative steps, as Python's `acceptance`: tau, the mean over steps
 * of accepted drafts + 1 (tokens decided per base pass; 1 for plain decoding, which records no steps), and
 * for draft positions 1..k, and on to the furthest a prompt lookup step accepted, the share of steps that
 * accepted the i-th draft (so tau = 1 + their sum).
 * @returns {[number, number[]]}
 */
export function acceptance(accepted, k) {
  if (!accepted.length) return [1, new Array(k).fill(0)];
  const tau = accepted.reduce((sum, a) => sum + a + 1, 0) / accepted.length;
  const positions = Math.max(k, ...accepted);  // a prompt lookup step may accept more than k
  return [tau, Array.from({ length: positions }, (_, i) => accepted.filter((a) => a >= i + 1).length / accepted.length)];
}
