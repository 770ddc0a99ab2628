"""Small helpers every area uses: atomic files, thread counts, host->device copies without a stream
synchronisation, speculative metrics and phase timers."""
