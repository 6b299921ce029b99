"""The contract's state rules, including SGLang 0.5.23's exact weight-update session messages."""

from __future__ import annotations

import pytest

from rlrun.engine.lifecycle import EngineLifecycle

# Copied from sglang 0.5.23 srt/managers/scheduler_components/weight_updater.py (the reference).
SGLANG_NOT_IN_SESSION = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
SGLANG_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
SGLANG_NO_SESSION = "no weight-update session is open; call begin_weight_update() first"


def test_generate_is_refused_while_any_tag_is_released_or_paused():
    life = EngineLifecycle()
    life.release(["kv_cache"])
    with pytest.raises(RuntimeError, match=r"released.*resume_memory_occupation"):
        with life.generating():
            pass
    life.resume(["kv_cache"])
    life.paused = True
    with pytest.raises(RuntimeError, match="paused"):
        with life.generating():
            pass
    life.paused = False
    with life.generating():
        assert life.num_inflight == 1
    assert life.num_inflight == 0


def test_release_with_requests_in_flight_is_refused():
    life = EngineLifecycle()
    with life.generating():
        with pytest.raises(RuntimeError, match=r"1 request\(s\) in flight"):
            life.release(None)
        assert life.check_flush()["success"] is False
    assert life.released_tags == set()
    assert life.check_flush() is None


def test_release_and_resume_tags():
    life = EngineLifecycle()
    assert life.release(None) == ["kv_cache", "weights", "cuda_graph"]
    with pytest.raises(RuntimeError, match="already released"):
        life.release(["weights"])
    assert life.resume(["weights"]) == ["weights"]
    with pytest.raises(RuntimeError, match=r"tags \['weights'\] must follow their release"):
        life.resume(["weights"])
    with pytest.raises(ValueError, match="must be among"):
        life.release(["optimizer"])
    assert life.status("v")["released_tags"] == ["cuda_graph", "kv_cache"]


def test_update_session_rules_use_sglang_messages():
    life = EngineLifecycle()
    assert life.check_update("update_weights_from_tensor") == {"success": False, "message": SGLANG_NOT_IN_SESSION}
    assert life.end_update() == {"success": False, "message": SGLANG_NO_SESSION}
    assert life.begin_update() == {"success": True, "message": "Success"}
    assert life.begin_update() == {"success": False, "message": SGLANG_ALREADY_OPEN}
    assert life.check_update("update_weights_from_tensor") is None
    life.release(["weights"])
    refused = life.check_update("update_weights_from_tensor")
    assert refused["success"] is False and "weights tag is released" in refused["message"]
    life.resume(["weights"])
    assert life.end_update() == {"success": True, "message": "Success"}
    assert life.status("v")["in_update_session"] is False
