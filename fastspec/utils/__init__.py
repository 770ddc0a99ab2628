"""Small helpers every area uses: the cache's root, atomic files, thread counts, host->device copies without a stream
synchronisation, speculative metrics and phase timers."""
