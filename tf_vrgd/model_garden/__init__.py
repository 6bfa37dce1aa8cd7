"""TF Model Garden support: `import tf_vrgd.model_garden` registers the VR
optimizers in Model Garden's optimizer factory (`registration`), whose
`OptimizationConfig` an experiment uses to read them from a config file;
`optimizers` holds the tf_keras faces of every optimizer of the package.

Needs tf_keras and Model Garden (`official`): see the README's "Inside
Model Garden" for the install. `import tf_vrgd` does not import this
package.
"""

from tf_vrgd.model_garden import optimizers
from tf_vrgd.model_garden.registration import (
    VR_TYPES,
    OptimizationConfig,
    OptimizerConfig,
    register,
)

register()

__all__ = ["VR_TYPES", "OptimizationConfig", "OptimizerConfig", "optimizers", "register"]
