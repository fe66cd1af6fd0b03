"""The static site: `build` (build.py) renders it, `serve` (serve.py) serves it; browser.py drives headless Chromium."""
