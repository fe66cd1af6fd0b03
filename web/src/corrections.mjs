// Proofreader's corrections: where a corrected text differs from its input, found by a character diff (the
// longest common subsequence) and widened to whole words, as `{startIndex, endIndex, correction}` over the
// input, sorted: input.substring(startIndex, endIndex) is the span replaced by `correction`.

const WORD = /[\p{L}\p{N}\p{M}'’_-]/u;

/** The edit script of a -> b as runs: {eq: text} or {del: text of a, ins: text of b}, in order; by code
 * points, so that no run splits a surrogate pair. */
function diffRuns(textA, textB) {
  const a = Array.from(textA);
  const b = Array.from(textB);
  // common prefix and suffix first: a sentence with a few typos leaves a small table in between
  let start = 0;
  while (start < a.length && start < b.length && a[start] === b[start]) start += 1;
  let end = 0;
  while (end < a.length - start && end < b.length - start && a[a.length - 1 - end] === b[b.length - 1 - end]) end += 1;
  const x = a.slice(start, a.length - end);
  const y = b.slice(start, b.length - end);
  const n = x.length;
  const m = y.length;
  const lcs = new Uint32Array((n + 1) * (m + 1));  // lcs[i * (m + 1) + j]: of x[i:] and y[j:]
  for (let i = n - 1; i >= 0; i -= 1) {
    for (let j = m - 1; j >= 0; j -= 1) {
      lcs[i * (m + 1) + j] = x[i] === y[j] ? lcs[(i + 1) * (m + 1) + j + 1] + 1
        : Math.max(lcs[(i + 1) * (m + 1) + j], lcs[i * (m + 1) + j + 1]);
    }
  }
  const runs = [{ eq: a.slice(0, start).join('') }];
  const push = (kind, ch) => {
    const last = runs.at(-1);
    if (kind === 'eq') {
      if ('eq' in last) last.eq += ch;
      else runs.push({ eq: ch });
    } else {
      if (!('del' in last)) runs.push({ del: '', ins: '' });
      runs.at(-1)[kind] += ch;
    }
  };
  let i = 0;
  let j = 0;
  while (i < n || j < m) {
    if (i < n && j < m && x[i] === y[j]) {
      push('eq', x[i]);
      i += 1;
      j += 1;
    } else if (j < m && (i === n || lcs[i * (m + 1) + j + 1] >= lcs[(i + 1) * (m + 1) + j])) {
      push('ins', y[j]);
      j += 1;
    } else {
      push('del', x[i]);
      i += 1;
    }
  }
  push('eq', a.slice(a.length - end).join(''));
  return runs.filter((r) => r.eq !== '');
}

/**
 * The corrections that turn input into corrected: each change of the character diff widened to the whole
 * words it touches (a changed letter corrects its word), changes in one word merged.
 * @param {string} input
 * @param {string} corrected
 * @returns {{startIndex: number, endIndex: number, correction: string}[]}
 */
export function corrections(input, corrected) {
  const runs = diffRuns(input, corrected);
  // move the word characters of an unchanged run that touch a change into that change
  for (let r = 0; r < runs.length; r += 1) {
    if (!('eq' in runs[r])) continue;
    const text = runs[r].eq;
    let head = 0;
    if (r > 0) while (head < text.length && WORD.test(text[head])) head += 1;
    let tail = text.length;
    if (r < runs.length - 1) while (tail > head && WORD.test(text[tail - 1])) tail -= 1;
    if (r > 0 && head) {
      runs[r - 1].del += text.slice(0, head);
      runs[r - 1].ins += text.slice(0, head);
    }
    if (r < runs.length - 1 && tail < text.length) {
      runs[r + 1].del = text.slice(tail) + runs[r + 1].del;
      runs[r + 1].ins = text.slice(tail) + runs[r + 1].ins;
    }
    runs[r].eq = text.slice(head, tail);
  }
  const out = [];
  let at = 0;
  let joined = false;  // the last change met no unchanged text since: the next one extends it
  for (const run of runs) {
    if ('eq' in run) {
      at += run.eq.length;
      joined = run.eq === '' && out.length > 0;
      continue;
    }
    if (joined) {
      const last = out.at(-1);
      last.endIndex += run.del.length;
      last.correction += run.ins;
    } else {
      out.push({ startIndex: at, endIndex: at + run.del.length, correction: run.ins });
    }
    at += run.del.length;
    joined = true;
  }
  return out;
}
