"""No Dynamo trace at a warm start: Dynamo's own output (bytecode and guards) stored as an entry
beside the graphs it calls (:mod:`aotc.dynamo_artifacts.build`, ``aotc.precompile``) and loaded without
a trace (:mod:`aotc.dynamo_artifacts.load`, ``aotc.precompiled``); transformers' ``generate()``
(:mod:`aotc.dynamo_artifacts.hf`)."""
