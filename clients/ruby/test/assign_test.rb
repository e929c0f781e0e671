# frozen_string_literal: true

# The fallback's port of the rollout assignment picks the revision the sidecar picks: every
# case of policy/testdata/assign-vectors.json, and the table of malformed input that every
# adapter answers alike.
require_relative "test_helper"
require "rebound/assign"

class AssignTest < Minitest::Test
  VECTORS = File.join(REPO, "policy", "testdata", "assign-vectors.json")
  REVISION = "sha256:83403d689b2445ce65ae8dfbd8befab76e501eef99841c316a1883e9ca8b2b4c"
  # In bucket 0 for REVISION: a port that read malformed steps anyway would answer CANARY.
  JOB = "job-186587197682"
  FIRST = 1_800_000_600_000
  NOW = 1_800_086_400_000
  S0 = "1800000000000"
  S1 = "1800000600000"

  def steps(*pairs)
    pairs.map { |w, s| { "weight" => w, "startUnixMs" => s } }
  end

  def cases
    doc = JSON.parse(File.read(VECTORS))
    assert_equal "rebound.dev/assign-vectors/v1", doc["format"]
    assert_operator doc["cases"].length, :>, 100
    doc["cases"]
  end

  def arm(*args)
    Rebound::Assign.arm(*args)
  end

  def test_every_vector_bit_for_bit
    all = cases
    mismatches = all.filter_map do |c|
      first = c["firstFailureUnixMs"]&.then { |v| Integer(v, 10) }
      got = arm(c["revision"], c["steps"], c["jobId"], first, Integer(c["nowUnixMs"], 10))
      [c["name"], got, c["expected"]] if got != c["expected"]
    end
    assert_equal [], mismatches.first(3), "#{mismatches.length} of #{all.length} differ"
  end

  def test_a_rollout_prepared_once_answers_like_the_one_shot_form
    prepared = {}
    cases.each do |c|
      rollout = prepared[[c["revision"], c["steps"]]] ||= Rebound::Assign::PreparedRollout.new(c["revision"], c["steps"])
      first = c["firstFailureUnixMs"]&.then { |v| Integer(v, 10) }
      assert_equal c["expected"], Rebound::Assign.arm_prepared(rollout, c["jobId"], first, Integer(c["nowUnixMs"], 10)), c["name"]
    end
    assert_operator prepared.length, :>=, 5
  end

  def test_times_as_decimal_strings_give_the_same_answers
    cases.each do |c|
      assert_equal c["expected"], arm(c["revision"], c["steps"], c["jobId"], c["firstFailureUnixMs"], c["nowUnixMs"]), c["name"]
    end
  end

  def test_the_vectors_cover_every_kind
    seen = []
    revisions = cases.map do |c|
      job = c["jobId"]
      seen << c["expected"]["arm"]
      seen << (if job.nil? then "nojob" elsif job.empty? then "emptyjob" elsif !job.ascii_only? then "nonascii" else "job" end)
      seen << "bynow" if job && !job.empty? && !c.key?("firstFailureUnixMs")
      c["revision"]
    end
    assert_empty %w[STABLE CANARY nojob emptyjob nonascii bynow] - seen
    assert_operator revisions.uniq.length, :>=, 2, "a single revision: the salt is not exercised"
  end

  def test_malformed_steps_give_stable
    assert_equal({ "arm" => "CANARY", "bucket" => 0 }, arm(REVISION, steps([10, S0], [50, S1]), JOB, FIRST, NOW), "control")
    {
      "weight 0" => steps([0, S0]),
      "weight 100" => steps([100, S0]),
      "weights equal" => steps([10, S0], [10, S1]),
      "weights decreasing" => steps([50, S0], [10, S1]),
      "starts decreasing" => steps([10, S1], [50, S0]),
      "11 steps" => steps(*(1..11).map { |w| [w, S0] }),
      "weight 10.5" => steps([10.5, S0]),
      'weight "10"' => steps(["10", S0]),
      "weight true" => steps([true, S0]),
      "weight missing" => [{ "startUnixMs" => S0 }],
      "start -1" => steps([10, -1]),
      'start "abc"' => steps([10, "abc"]),
      "start 2^64" => steps([10, "18446744073709551616"]),
      "start missing" => [{ "weight" => 10 }],
      "steps null" => nil,
      "steps an object" => { "weight" => 10, "startUnixMs" => S0 },
      "a step not an object" => [10]
    }.each do |name, s|
      assert_equal({ "arm" => "STABLE", "bucket" => 0 }, arm(REVISION, s, JOB, FIRST, NOW), name)
    end
  end

  def test_malformed_arguments_give_stable
    good = steps([10, S0])
    assert_equal({ "arm" => "STABLE", "bucket" => 0 }, arm(REVISION, good, JOB, "abc", NOW))
    assert_equal({ "arm" => "STABLE", "bucket" => 0 }, arm(REVISION, good, JOB, nil, "abc"))
    assert_equal({ "arm" => "STABLE", "bucket" => 0 }, arm(REVISION, good, JOB, -5, NOW))
    assert_equal({ "arm" => "STABLE" }, arm(nil, good, JOB, FIRST, NOW))
    assert_equal({ "arm" => "STABLE" }, arm(42, good, JOB, FIRST, NOW))
    assert_equal({ "arm" => "STABLE" }, arm(REVISION, good, 42, FIRST, NOW))
    assert_equal({ "arm" => "STABLE" }, arm(REVISION, good, "job-\xFF".dup.force_encoding("UTF-8"), FIRST, NOW), "job id not UTF-8")
    assert_equal({ "arm" => "STABLE" }, arm("sha256:\xED\xA0\x80".dup.force_encoding("UTF-8"), good, JOB, FIRST, NOW), "revision not UTF-8")
    assert_equal({ "arm" => "STABLE" }, arm(REVISION, good, "job-\xFF".b, FIRST, NOW), "binary job id")
  end

  def test_an_id_in_another_encoding_is_hashed_as_utf8
    job = "commande-é"
    want = arm(REVISION, steps([10, S0]), job, FIRST, NOW)
    assert_equal want, arm(REVISION, steps([10, S0]), job.encode("ISO-8859-1"), FIRST, NOW)
  end

  def test_any_mix_of_odd_arguments_gives_a_well_formed_answer
    pool = [nil, "", "x", "abc", "\xFF".b, -1, 0, 1.5, Float::NAN, Float::INFINITY, 2**64,
            "18446744073709551616", REVISION, JOB, S0, FIRST, NOW, [], {}, [nil], [{}],
            steps([10, S0]), steps([10, S0], [50, S1]), true, :job]
    rng = Random.new(12_345)
    5000.times do
      got = arm(*Array.new(5) { pool[rng.rand(pool.length)] })
      assert_includes %w[STABLE CANARY], got["arm"]
      assert_empty got.keys - %w[arm bucket]
      assert got.fetch("bucket", 0).between?(0, 99)
    end
  end

  def test_an_unknown_first_failure_is_placed_by_now
    [nil, 0, "0"].each do |unknown|
      assert_equal "CANARY", arm(REVISION, steps([10, S0]), JOB, unknown, Integer(S0))["arm"], unknown.inspect
      assert_equal "STABLE", arm(REVISION, steps([10, S0]), JOB, unknown, Integer(S0) - 1)["arm"], unknown.inspect
    end
  end
end
