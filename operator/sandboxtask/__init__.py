"""SandboxTask: one restricted pod per attempt.
:mod:`.plan` decides, :mod:`.builders` builds, :mod:`.reconciler` applies (claiming a warm
pod first when the task names a pool), :mod:`.artifacts` signs its storage URLs.
"""
