"""Text generation: a causal LM compiled into a prefill and a decode program over one copy of the
weights with a static key/value cache (:mod:`~compiler.generation.step`), its limits as data
(:mod:`~compiler.generation.spec`), ``generate`` over the two (:mod:`~compiler.generation.module`),
the package holding both (:mod:`~compiler.generation.package`) and its validation against eager
generation (:mod:`~compiler.generation.validate`)."""
