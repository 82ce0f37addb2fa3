"""SGLang transfer backend: ``--disaggregation-transfer-backend kvxferd``.

Loaded by SGLang's plugin loader through the ``sglang.srt.plugins`` entry point
(:func:`kvxferd.adapters.sglang.plugin.register`); nothing in SGLang is edited.
Tested against sglang 0.5.23; the backend interfaces change between releases.

- :mod:`.layout`: KVArgs and pool shapes -> kvxferd geometry, page and token arithmetic (pure)
- :mod:`.polling`: kvxferd request states -> SGLang's ``KVPoll`` (pure)
- :mod:`.state`, :mod:`.window`, :mod:`.draft`: Mamba state, sliding-window layers and
  draft-model KV -> kvxferd cache groups (pure)
- :mod:`.bootstrap`: the prefill side's bootstrap server (instance and daemon address)
- :mod:`.manager`: the per-rank manager SGLang builds (regions, groups, registration)
- :mod:`.conn`: the per-request sender and receiver and the bootstrap server SGLang builds
- :mod:`.plugin`: the hooks that add the backend to SGLang
"""

SGLANG_VERSION = "0.5.23"
