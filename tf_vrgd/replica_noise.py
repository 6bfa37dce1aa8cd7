"""Independent random-layer noise on each replica.

Keras 3 keeps a random layer's stream (`Dropout`, `GaussianNoise`, ...) in
one `SeedGenerator` whose state is a single mirrored variable under a
`tf.distribute` strategy, so every replica draws the same masks. The
per-replica gradients a VR optimizer compares then share their dropout
noise, and the GSNR's variance misses that part: identical examples on two
replicas give identical gradients, not two samples of the stochastic
gradient. `independent_replica_noise(model)` folds each replica's index into
the seeds its random layers draw, so replicas draw masks of their own, as
separate devices do in the data-parallel training the paper describes.
"""

import tensorflow as tf

# Keras' seeds are below 2**32: adding the replica index times this keeps
# every (seed, replica) pair distinct.
REPLICA_STRIDE = 2**32


def independent_replica_noise(model):
    """Gives each replica its own stream in every random layer of `model`.

    Replica r draws with the layer's seed plus `r * 2**32`; replica 0, one
    replica, and calls outside a strategy draw exactly what they drew
    before. The streams stay deterministic (a resumed run that restores the
    generators' states draws the same masks). Calling it again changes
    nothing.

    Args:
        model: A Keras model (or layer); its nested layers are included.

    Returns:
        The number of seed generators now drawing per replica.
    """
    generators = seed_generators(model)
    for generator in generators:
        _draw_per_replica(generator)
    return len(generators)


def seed_generators(model):
    """The `SeedGenerator`s of `model`'s random layers, nested ones
    included."""
    return [
        generator
        for layer in model._flatten_layers()
        for generator in getattr(layer, "_seed_generators", ())
    ]


def shared_streams(model):
    """The number of seed generators of `model`'s random layers that draw
    the same values on every replica (not yet through
    `independent_replica_noise`)."""
    return sum(
        not getattr(generator, "_draws_per_replica", False) for generator in seed_generators(model)
    )


def _draw_per_replica(generator):
    if getattr(generator, "_draws_per_replica", False):
        return
    draw = generator.next

    def next(ordered=True):
        seed = draw(ordered)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return seed
        replica = tf.cast(context.replica_id_in_sync_group, seed.dtype)
        return seed + tf.stack([replica * REPLICA_STRIDE, tf.zeros_like(replica)])

    generator.next = next
    generator._draws_per_replica = True
