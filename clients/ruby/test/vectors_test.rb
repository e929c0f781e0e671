# frozen_string_literal: true

# The fallback's port of decide gives every answer of policy/testdata/decide-vectors.json.
require_relative "test_helper"
require "rebound/decide"

class VectorsTest < Minitest::Test
  VECTORS = File.join(REPO, "policy", "testdata", "decide-vectors.json")
  FIELDS = %w[decision delayMs disposition deadLetterQueue reason reasonMessage].freeze

  def test_every_vector_bit_for_bit
    doc = JSON.parse(File.read(VECTORS))
    assert_equal "rebound.dev/decide-vectors/v1", doc["format"]
    cases = doc["cases"]
    assert_operator cases.length, :>, 100
    mismatches = cases.filter_map do |c|
      got = Rebound::Decide.decide_local(c["policy"], c["identity"], c["attempt"], c["context"])
      want = c["expected"]
      [c["name"], got.slice(*FIELDS), want] if FIELDS.any? { |f| got[f] != want[f] }
    end
    assert_equal [], mismatches.first(3), "#{mismatches.length} of #{cases.length} differ"
  end

  def test_a_changed_answer_is_noticed
    c = JSON.parse(File.read(VECTORS))["cases"].find do |x|
      x["policy"]["jitter"] == "JITTER_FULL" && x["expected"]["delayMs"] > 1000 && x["context"]["jobId"] && !x["context"]["retryAfterMs"]
    end
    got = Rebound::Decide.decide_local(c["policy"], c["identity"], c["attempt"], c["context"].merge("jobId" => c["context"]["jobId"] + "x"))
    refute_equal c["expected"]["delayMs"], got["delayMs"], "the job id seeds the jitter"
  end
end
