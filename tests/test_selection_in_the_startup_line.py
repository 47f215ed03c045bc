"""The start-up line names each route's selection rule with every option it runs with, defaults written out, so a
run's log says what it ran even when the command gave no option."""
from routing_module import resolve_routes
from training.run_log import describe_routes


def routes(**fields):
    return resolve_routes([dict(start_layer_idx=2, end_layer_idx=8, selection_ratio=0.5, **fields)], 12)


def test_importance_selection_without_options_shows_its_default_mix():
    assert describe_routes(routes(selection="importance")) == "2->8 at 0.5 (importance selection importance_mix=0)"


def test_a_given_option_is_shown_as_given():
    assert describe_routes(routes(selection="importance", options={"importance_mix": 0.25})) == \
        "2->8 at 0.5 (importance selection importance_mix=0.25)"


def test_random_selection_has_no_options_to_show():
    assert describe_routes(routes()) == "2->8 at 0.5 (random selection)"
