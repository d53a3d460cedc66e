"""The stages of a DP-SGD step, in the order `DPEngine` runs them (private: the public surface is `flashdp`).

At `make_private`:
    settings.py     the engine's settings, checked once (`EngineSettings`)
    plan.py         the gradient plan: the rule counting each trainable parameter (registered rules, else the
                    generic one in flashdp.rules.generic), the hooked modules, the clipping groups; params.py:
                    how a parameter is identified whatever wraps the model

Each `engine.backward(loss)`:
    1. record       recorder.py: forward hooks keep references to each trainable layer call's inputs and the
                    gradient edge of its output
    -  guards       guards.py (the loss, the model's parameters), provenance.py (no gradient but engine.backward's),
                    grad_writes.py (no `.grad` write during the backward but flashdp's own)
    -  knowledge    knowledge.py: what the engine trusts about the model and on what evidence (the plan, shared
                    outputs, verified forward structures), one immutable value committed when a backward succeeds
    -  coverage     coverage.py: every trainable parameter reaches the loss only inside calls that count it
                    (every backward whose forward structure is not yet verified)
    2. norm pass    norm_pass.py: one autograd pass to those edges (no parameter gradient); each call's output
                    gradient is handed over as autograd computes it (shared_outputs.py: per-sample gradients of
                    outputs shared across the batch) to collector.py, where the call's rule turns it into
                    per-sample gradients and a parameter's norms are computed once its last call is in
    -  self-check   self_check.py: on the first backward and every N, what was counted against autograd's own
                    per-sample gradients on the same graph
    3. norms        param_grad.py: per parameter, the exact squared norm of the sum of its contributions and a
                    `ClippedSumPlan` of what the clipped sum needs (outer_products.py: the math on outer-product
                    blocks, and the cost model choosing ghost or direct norms);
                    nonfinite.py: float32 overflow recomputed in float64, NaN / inf samples refused or skipped
    4. coefficients clipping.py: per-sample clipping coefficients from the norms of each clipping group
    5. sums         bk: each plan's `sum_i c_i g_i`; ghost / flash: a second backward of `sum_i c_i loss_i`
    6. adapter      `flashdp.distributed`: where the sums go (local `.grad`, DDP, FSDP2 or FSDP1 shards)

Each `engine.step()`: the adapter's gradient reduction, noise (`flashdp.privacy`), 1 / expected_batch_size, the
optimizer, the accountant. profiling.py times every phase on request.
"""
