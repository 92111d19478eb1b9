"""The check the parallel tests share: predicted model-state peaks equal the ledger's, byte for byte."""
from __future__ import annotations

MODEL_STATES = ("param", "param_gathered", "master", "optim_state", "grad")


def assert_model_states_predicted(measured: dict[str, int], where: str, **predictions: dict[str, int]) -> None:
    """Each ``predictions`` entry (by who predicted: ``estimate=``, ``engine=``) equals ``measured`` per category."""
    for who, predicted in predictions.items():
        for category in MODEL_STATES:
            assert predicted[category] == measured[category], \
                f"{where}: {category} predicted by {who} {predicted[category]}, measured {measured[category]}"
