"""An engine option's default lives once, in engines/spec.py ENGINE_OPTIONS, and every reader asks
the spec (`OptimizationSpec.option`) instead of repeating it in a `.get(key, default)`."""

import pytest
from engines.spec import ENGINE_OPTIONS, OptimizationSpec


def test_a_given_option_wins_and_a_missing_one_reads_the_engines_default():
    reference = OptimizationSpec(engine="reference", engine_options={"batch_size": 2})
    assert reference.option("batch_size") == 2  # given
    assert reference.option("concurrency") == 1 and reference.option("calibration_samples") == 128  # the table's
    assert reference.option("calibration_tokens") is None  # unset: the engine takes min(512, context)
    served = OptimizationSpec(engine="openai", engine_options={"base_url": "http://h:8000/v1"})
    assert (served.option("timeout_s"), served.option("concurrency"), served.option("dedicated_server")) == (60, 1, False)
    assert reference.option("dedicated_server") is None  # another engine's option: this engine has none


def test_a_name_no_engine_has_is_a_key_error():
    with pytest.raises(KeyError, match="no engine has an option 'batchsize'"):
        OptimizationSpec(engine="reference").option("batchsize")


def test_every_default_has_the_options_type():
    for engine, options in ENGINE_OPTIONS.items():
        for name, option in options.items():
            assert option.default is None or isinstance(option.default, option.kind), (engine, name)


def test_int4_gemv_takes_one_of_its_kernels_and_names_them_when_not():
    from engines.kernels.w4a16 import INT4_GEMV
    from engines.spec import ConfigNotAvailable

    assert ENGINE_OPTIONS["reference"]["int4_gemv"].choices == INT4_GEMV  # the kernel's own list
    assert OptimizationSpec(engine="reference", weights="rtn-int4").option("int4_gemv") == "auto"
    OptimizationSpec(engine="reference", weights="rtn-int4", engine_options={"int4_gemv": "triton"}).check_available()
    bad = OptimizationSpec(engine="reference", weights="rtn-int4", engine_options={"int4_gemv": "marlin"})
    with pytest.raises(ConfigNotAvailable, match=r"engine_options\.int4_gemv: 'marlin' is not one of auto, tinygemm, triton"):
        bad.check_available()
