"""What every kind shares: builder helpers (:mod:`.builders`), observed-pod views and the
status diff (:mod:`.views`), the sandbox pod's shared parts (:mod:`.sandbox`,
:mod:`.sandbox_namespace`), the reconcilers' common state and write helpers
(:mod:`.state`) and per-namespace storage credentials (:mod:`.storage_credentials`).

Nothing here imports a kind's package; every kind imports from here.
"""
