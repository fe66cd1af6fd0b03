// The tasks' one prompt format and the text of token ids, as builder/data/tasks.py: a prompt is the task's
// prefix ids (from the manifest), the ids of the user's text, then the task's suffix ids.

import { PageError, listed } from './errors.mjs';

export class TaskTokenizer {
  /**
   * @param {object} tokenizer  a tokenizers.js Tokenizer built WITHOUT added tokens, so that special tokens
   *   are encoded by id only, never parsed out of the user's text: "<|fix|>" typed by a user stays text
   * @param {object} manifest   models/manifest.json: its tasks and special tokens
   */
  constructor(tokenizer, manifest) {
    this.tokenizer = tokenizer;
    this.tasks = manifest.tasks;  // task -> {prefix: ids, suffix: ids}
    this.special = new Set(Object.values(manifest.special_tokens));
  }

  /** The ids of plain text (no special tokens recognised in it), as Python's encode_text. */
  encodeText(text) {
    // a lone surrogate (half a UTF-16 pair) becomes U+FFFD, as builder/data/tasks.py's well_formed
    return text ? this.tokenizer.encode(text.toWellFormed(), { add_special_tokens: false }).ids : [];
  }

  /** The prompt's ids in the task's one format: prefix + text + suffix. */
  encodePrompt(task, text) {
    const format = this.tasks[task];
    if (!format) throw new PageError(`unknown task "${task}": choose ${listed(Object.keys(this.tasks))}`);
    if (typeof text !== 'string') throw new PageError(`the prompt must be text, got ${typeof text}`);
    if (!text.trim()) throw new PageError('the prompt is empty');
    return [...format.prefix, ...this.encodeText(text), ...format.suffix];
  }

  /** The text of new ids, special tokens left out (as Python's decode). */
  decode(ids) {
    const text = ids.filter((id) => !this.special.has(id));
    return text.length ? this.tokenizer.decode(text) : '';  // tokenizers.js refuses an empty list
  }
}

/**
 * tokenizer.json with each `Digits` pre-tokenizer written as the Split it stands for. The Rust tokenizers
 * (Python, llama.cpp's "smollm" pre-tokenizer) split off every Unicode number character (char::is_numeric:
 * "١٢٣", "½", "²"); tokenizers.js's Digits splits only ASCII 0-9, so SmolLM2's ids would differ on them.
 */
export function unicodeDigits(json) {
  const rewrite = (pre) => {
    if (!pre) return pre;
    if (pre.type === 'Sequence') return { ...pre, pretokenizers: pre.pretokenizers.map(rewrite) };
    if (pre.type !== 'Digits') return pre;
    return { type: 'Split', pattern: { Regex: pre.individual_digits ? '\\p{N}' : '\\p{N}+' },
      behavior: 'Isolated', invert: false };
  };
  return { ...json, pre_tokenizer: rewrite(json.pre_tokenizer) };
}
