"""`tachy bench`: load generation and measurement for OpenAI-compatible servers (serve), and the
offline engine (throughput, latency). See docs/bench.md."""
