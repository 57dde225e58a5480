"""The probe: hooks that measure each layer on report steps and reduce at capture time.

What a report step measures (:mod:`.plan`), the hooks and the ``qkwatch-measure`` thread
(:mod:`.probe`), the weights read when a step is armed (:mod:`.weights`, cached by
:mod:`.weight_versions`), the rows of q and k the activation metrics read (:mod:`.activations`)
and the custom op a compiled forward taps through (:mod:`.compiled_tap`).
"""
