"""Frozen MTP in the browser: model, training, reference decoding and (later) export and site rendering."""
