"""The stages of a DP-SGD step, in the order `DPEngine` runs them (private: the public surface is `flashdp`).

Each stage is a module with one job; the engine (`flashdp.engine`, a façade) threads values through them. The one
value that lives across backwards is `Knowledge` (knowledge.py): what the engine trusts about the model and on
what evidence (the plan, shared outputs, layers not batch-first, verified forward structures, the self-check
schedule). A backward derives new values from it and the engine commits the last only when the backward succeeds.

At `make_private`:
    settings.py       the engine's settings, checked once (`EngineSettings`)
    plan.py           the gradient plan: the rule counting each trainable parameter (registered rules, else the
                      generic one in flashdp.rules.generic), the hooked modules, the clipping groups; params.py:
                      how a parameter is identified whatever wraps the model
    attachment.py     the hooks on the model (recorder, gradient guards) and their removal
    clipped_sums.py   how the clipped sums reach `.grad` (bk, a second pass, or norms only), resolved once, and
                      what the norm pass keeps for them

Each `engine.backward(loss)`:
    1. record         recorder.py: forward hooks keep references to each trainable layer call's inputs and the
                      gradient edge of its output; `take()` hands the calls over with the plan they were recorded
                      under (a module's rule checked on its first call: its scale, or the generic rule)
    -  guards         guards.py (the loss, the model's parameters), provenance.py (no gradient but
                      engine.backward's), grad_writes.py (no `.grad` write during the backward but flashdp's own)
    2. measure        measurement.py, the one retry loop: the loss graph indexed once (loss_graph.py); on every
                      backward, the coverage walk (coverage.py: every parameter reaches the loss only inside calls
                      that count it); on a forward structure not yet verified (layout.py: keyed by sizes alone;
                      routing.py: under the index values of the ops moving rows between the layers and the loss),
                      or a use found outside those calls, what it learns (learning.py); then attempts, each one
                      norm pass that returns the pass or a finding
       norm pass      aliasing.py, first: each output edge's gradient counted once per parameter (a tensor returned by
                      several calls, such as a returned parameter, or twice by one), else refused; then
                      norm_pass.py: one autograd pass to the calls' output edges (no parameter gradient); each call's
                      output gradient is handed over as autograd computes it (shared_outputs.py: per-sample
                      gradients of outputs shared across the batch) to collector.py, where the call's rule turns it
                      into per-sample gradients and a parameter's norms are computed once its last call is in;
                      verifying.py: on a new structure, sketches for the check that every layer's rows are samples
       norms          param_grad.py: per parameter, the exact squared norm of the sum of its contributions and a
                      `ClippedSumPlan` (outer_products.py: the math on outer-product blocks, and the cost model
                      choosing ghost or direct norms); nonfinite.py: float32 overflow recomputed in float64,
                      NaN / inf samples refused or skipped
       self-check     self_check.py: on the first backward and every N, what was counted against autograd's own
                      per-sample gradients on the same graph
    3. coefficients   clipping.py: per-sample clipping coefficients from the norms of each clipping group
    4. sums           clipped_sums.py: bk: each plan's `sum_i c_i g_i`; ghost / flash: the norm pass again, each
                      layer's `sum_i c_i g_i` from the same output gradients (FSDP2: a second backward of
                      `sum_i c_i loss_i`); the adapter (`flashdp.distributed`) says where they go

Each `engine.step()`: `flashdp.noisy_step.NoisyStep`: its hooks, the adapter's gradient reduction, noise
(`flashdp.privacy`), 1 / expected_batch_size, the optimizer, the accountant. profiling.py times every phase on
request.
"""
