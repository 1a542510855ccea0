"""Journey 1: build → one Dynamo capture → split at the splitting ops → compile each unique piece
for every shape → check against eager → store.

The public function is :func:`aotc.compile` (a plain function in ``aotc/__init__.py``); this
package holds no code so that importing it is free.
"""
