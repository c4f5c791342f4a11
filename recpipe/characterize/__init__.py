"""``recpipe characterize``: one command measures a platform (sequential per-stage latency, a closed-loop
concurrency sweep, SLO searches, the per-stage micro-benchmarks, CPU seconds per query, GPU busy
fraction) into one versioned JSON document, section by section; ``recpipe report`` renders one and
compares two."""
