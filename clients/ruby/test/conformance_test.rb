# frozen_string_literal: true

# clients/conformance/scenarios.json on real `sidekiq` processes, Redis (dev/redis.sh) and
# rebound-sidecars serving clients/conformance/policies.yaml (namespace conformance). Each
# scenario id has a test named test_conformance_<id> (with `__<variant>` for variants);
# test_every_scenario_has_a_ruby_test fails when one has none. The dead-letter queue
# (fixed-3-dead) is not worked here, so its messages stay on it to be counted.
require_relative "worker_test"
require "rebound/reliable_fetch"

module Conf
  module_function

  SCENARIOS = File.join(REPO, "clients", "conformance", "scenarios.json")
  POLICIES = File.join(REPO, "clients", "conformance", "policies.yaml")
  DLQ = "fixed-3-dead"
  QUEUES = %w[fixed-3 fixed-3-dlq fixed-3-drop].freeze

  def scenarios = JSON.parse(File.read(SCENARIOS))["scenarios"]
  def scenario(id) = scenarios.find { |s| s["id"] == id } || raise("no scenario #{id}")

  def sidecar(name = "conformance/sidecar", port: nil)
    Sidecar.new(POLICIES, name, probe_queue: "fixed-3", namespace: "conformance", port: port)
  end

  # The one sidecar and worker of the scenarios that need nothing special.
  def shared_sidecar
    @shared_sidecar ||= sidecar.start
  end

  def shared_worker
    @shared_worker ||= worker(shared_sidecar.target, "conformance/worker", QUEUES).start.tap { |w| Minitest.after_run { w.stop } }
  end

  # A sidekiq process on the conformance jobs; runs are recorded in the tests' Redis.
  def worker(target, name, queues, redis_url: nil, env: {}, concurrency: 2)
    SidekiqWorker.new(target, name, queues: queues, dead_letters: [], redis_url: redis_url, concurrency: concurrency,
      env: {"REBOUND_RECORD_URL" => Harness.redis_url}.merge(env))
  end

  def jobs_loaded
    @jobs_loaded ||= begin
      Harness.sidekiq_client
      require_relative "jobs"
      true
    end
  end
end

class ConformanceTest < Minitest::Test
  include JobAsserts

  Job = Struct.new(:token, :jid, :key, :kind)

  def setup
    Conf.jobs_loaded
  end

  def rec = Harness.sidekiq_client # the recording Redis (also the shared broker)

  # Enqueues a conformance job: kind :sidekiq_job (ConformJob) or :active_job (ConformActiveJob).
  def enqueue(kind, queue, opts = {}, extra = {})
    token = SecureRandom.hex(8)
    if kind == :active_job
      job = ConformActiveJob.set(queue: queue).perform_later(token, opts)
      Job.new(token, job.provider_job_id, job.job_id, kind)
    else
      jid = Sidekiq::Client.push({"class" => "ConformJob", "queue" => queue, "args" => [token, opts]}.merge(extra))
      Job.new(token, jid, jid, kind)
    end
  end

  def conf_runs(job) = rec.lrange("conf:runs:#{job.token}", 0, -1).map { |x| JSON.parse(x) }
  def done?(job) = rec.get("conf:done:#{job.token}")

  def dlq_messages(job, queue = Conf::DLQ)
    Sidekiq::Queue.new(queue).map(&:item).select { |i| i["args"].first.is_a?(Hash) && i["args"].first["jid"] == job.jid }.map { |i| i["args"].first }
  end

  def dead_entry(job) = Sidekiq::DeadSet.new.find_job(job.jid)

  def job_events(worker, event, job) = worker.events(event).select { |e| e["jid"] == job.jid }

  # With another Redis as the broker (a test of its own, or one that restarts it): the
  # test process's Sidekiq client points there meanwhile; runs stay recorded in the shared one.
  def with_broker(name, persist: false)
    dir = File.join(Harness.run_dir, "#{name}-redis")
    old = Sidekiq.redis_pool
    url = Harness.start_redis(dir, persist: persist)
    Sidekiq.redis = {url: url}
    yield url, dir
  ensure
    Sidekiq.redis = old if old
    Harness.stop_redis(dir) if dir
  end

  def expected_delays(target, queue, job, error_class, attempts)
    resolved, identity = policy_of(target, queue)
    attempts.map { |a| Rebound::Decide.decide_local(resolved, identity, a, {"jobId" => job.key, "errorClass" => error_class}) }
  end

  def self.kinds(name, &body)
    %i[sidekiq_job active_job].each { |kind| define_method("test_conformance_#{name}__#{kind}") { instance_exec(kind, &body) } }
  end

  def test_every_scenario_has_a_ruby_test
    names = Minitest::Runnable.runnables.flat_map(&:public_instance_methods).map(&:to_s).grep(/\Atest_conformance_/)
    missing = Conf.scenarios.map { |s| s["id"] }.reject do |id|
      base = "test_conformance_#{id.tr("-", "_")}"
      names.any? { |n| n == base || n.start_with?("#{base}__") }
    end
    assert_equal [], missing, "scenarios of clients/conformance/scenarios.json without a Ruby test"
  end

  kinds("retry_then_succeed") do |kind|
    w = Conf.shared_worker
    want = Conf.scenario("retry-then-succeed")["expect"]
    job = enqueue(kind, "fixed-3", {"fail" => 2})
    Harness.eventually("completion", 60) { done?(job) }
    seen = conf_runs(job)
    assert_equal want["runs"], seen.length
    assert_equal [job.key], seen.map { |r| r["jobId"] }.uniq # sameJobIdEveryRun
    answers = expected_delays(Conf.shared_sidecar.target, "fixed-3", job, "TransientError", [1, 2])
    retries = job_events(w, "rebound.retry", job)
    assert_equal [[1, "sidecar", "sidecar"], [2, "sidecar", "sidecar"]], retries.map { |e| e.values_at("attempt", "source", "policy_source") }
    assert_equal answers.map { |a| a["delayMs"] }, retries.map { |e| e["delay_ms"] }
    answers.each_with_index do |a, i| # gapsWithinPolicy
      gap = seen[i + 1]["ms"] - seen[i]["ms"]
      assert_operator gap, :>=, a["delayMs"]
      assert_operator gap, :<=, a["delayMs"] + 10_000
    end
    assert_nil dead_entry(job)
  end

  kinds("exhausted_dead_letter") do |kind|
    w = Conf.shared_worker
    want = Conf.scenario("exhausted-dead-letter")["expect"]
    job = enqueue(kind, "fixed-3-dlq", {"fail" => "always"})
    letters = Harness.eventually("the dead letter", 60) { dlq_messages(job).then { |l| l.empty? ? nil : l } }
    assert_equal want["runs"], conf_runs(job).length
    assert_equal want["deadLetters"], letters.length
    msg = letters.first
    assert_equal [job.jid, job.key, "fixed-3-dlq", want.fetch("reason", "GIVE_UP_REASON_MAX_ATTEMPTS"), want["deadLetterAttempts"]],
      msg.values_at("jid", "key", "queue", "reason", "attempts")
    assert_equal job.token, msg["args"].first
    assert_equal kind == :active_job ? "ConformActiveJob" : "ConformJob", msg["job_class"]
    entry = Harness.eventually("the dead set entry", 10) { dead_entry(job) } # libraryTerminal
    assert_equal [2, "TransientError", 3], entry.item.values_at("retry_count", "error_class", "rebound_runs")
    assert_equal 0, Sidekiq::RetrySet.new.count { |j| j.jid == job.jid }
    gave_up = job_events(w, "rebound.dead_lettered", job)
    assert_equal [[3, "DISPOSITION_DEAD_LETTER", true]], gave_up.map { |e| e.values_at("attempt", "disposition", "dead_set") }
  end

  kinds("exhausted_drop_keeps_job") do |kind|
    w = Conf.shared_worker
    want = Conf.scenario("exhausted-drop-keeps-job")["expect"]
    job = enqueue(kind, "fixed-3-drop", {"fail" => "always"})
    entry = Harness.eventually("the dead set entry", 60) { dead_entry(job) } # libraryTerminal, not discarded
    assert_equal want["runs"], conf_runs(job).length
    assert_equal [2, 3], entry.item.values_at("retry_count", "rebound_runs")
    assert_equal want["deadLetters"], dlq_messages(job).length
    assert_equal 0, Sidekiq::RetrySet.new.count { |j| j.jid == job.jid }
    dropped = job_events(w, "rebound.dropped", job)
    assert_equal [["GIVE_UP_REASON_MAX_ATTEMPTS", "DISPOSITION_DROP", true]], dropped.map { |e| e.values_at("reason", "disposition", "dead_set") }
  end

  kinds("non_retryable_error") do |kind|
    Conf.shared_worker
    want = Conf.scenario("non-retryable-error")["expect"]
    job = enqueue(kind, "fixed-3-dlq", {"fail" => "always", "error" => "PermanentError"})
    msg = Harness.eventually("the dead letter", 60) { dlq_messages(job).first }
    assert_equal want["runs"], conf_runs(job).length
    assert_equal want["deadLetters"], dlq_messages(job).length
    # The proto's (and the sidecar's) name is GIVE_UP_REASON_NON_RETRYABLE (an earlier
    # scenarios.json said ..._ERROR, which the proto does not have).
    reason = Rebound::V1::GiveUpReason.resolve(want["reason"].to_sym) ? want["reason"] : "GIVE_UP_REASON_NON_RETRYABLE"
    assert_equal reason, msg["reason"]
    assert_equal [1, "PermanentError"], msg.values_at("attempts", "error_class")
    assert Harness.eventually("the dead set entry", 10) { dead_entry(job) }
  end

  kinds("replayed_dead_letter") do |kind|
    Conf.shared_worker
    want = Conf.scenario("replayed-dead-letter")["expect"]
    job = enqueue(kind, "fixed-3-dlq", {"fail" => 3})
    msg = Harness.eventually("the dead letter", 60) { dlq_messages(job).first }
    Harness.eventually("the dead set entry", 10) { dead_entry(job) }
    assert_equal 3, conf_runs(job).length
    # The documented command (README, "Dead letters and replay"):
    assert_equal job.jid, Rebound::Sidekiq.replay(msg)
    Harness.eventually("the replayed job completed", 60) { done?(job) }
    assert_equal 3 + want["replayRuns"], conf_runs(job).length
    assert_equal [job.key], conf_runs(job).map { |r| r["jobId"] }.uniq # sameJobId
    assert_nil dead_entry(job)
    assert_equal 1, dlq_messages(job).length
  end

  # A replay that fails again: one more run, then the dead set and a second dead letter
  # whose attempts are the runs actually made (4), not Sidekiq's lowered count.
  kinds("replayed_dead_letter_failing_again_counts_every_run") do |kind|
    Conf.shared_worker
    job = enqueue(kind, "fixed-3-dlq", {"fail" => "always"})
    first = Harness.eventually("the dead letter", 60) { dlq_messages(job).first }
    Harness.eventually("the dead set entry", 10) { dead_entry(job) }
    Rebound::Sidekiq.replay(job.jid)
    letters = Harness.eventually("the second dead letter", 60) { dlq_messages(job).then { |l| l.length == 2 ? l : nil } }
    assert_equal 4, conf_runs(job).length
    assert_equal [3, 4], [first["attempts"], letters.map { |l| l["attempts"] }.max]
  end

  def test_conformance_default_policy_keeps_job
    want = Conf.scenario("default-policy-keeps-job")["expect"]
    nowhere = "127.0.0.1:#{Harness.free_port}" # never reachable
    w = Conf.worker(nowhere, "conformance/worker-no-sidecar", %w[conf-default]).start
    unavailable = Harness.eventually("the warning naming the target", 20) { w.events("rebound.sidecar_unavailable").first }
    assert_equal nowhere, unavailable["target"]
    # Its 10th run (retry_count 8: nine runs failed before).
    job = enqueue(:sidekiq_job, "conf-default", {"fail" => "always"}, {"retry_count" => 8, "failed_at" => Time.now.to_f})
    entry = Harness.eventually("the dead set entry", 30) { dead_entry(job) } # libraryTerminal
    (e,) = job_events(w, "rebound.dropped", job)
    assert_equal [10, want["decision"], want["disposition"], want["policySource"], want["source"], true],
      e.values_at("attempt", "decision", "disposition", "policy_source", "source", "dead_set")
    assert_equal 10, entry.item["rebound_runs"]
  ensure
    w&.stop
  end

  def test_conformance_outage_every_process_uses_real_policy
    want = Conf.scenario("outage-every-process-uses-real-policy")["expect"]
    with_broker("outage") do |url|
      sidecar = Conf.sidecar("conformance/sidecar-outage").start
      a = Conf.worker(sidecar.target, "conformance/outage-a", %w[fixed-3-dlq], redis_url: url).start
      Harness.eventually("the policy prefetched at start", 20) { a.events("rebound.policy_fetched").any? { |e| e["queue"] == "fixed-3-dlq" } }
      target = sidecar.target
      probe = Conf.sidecar("conformance/sidecar-outage-probe").start # the same policies, to compute the answers
      sidecar.kill # before any job failed
      b = nil
      [[a, "a"], [:b, "b"]].each do |w, name|
        if w == :b # a process started after the kill
          w = b = Conf.worker(target, "conformance/outage-b", %w[fixed-3-dlq], redis_url: url).start
          assert_equal target, Harness.eventually("b's warning", 20) { b.events("rebound.sidecar_unavailable").first }["target"]
          a.stop
        end
        job = enqueue(:sidekiq_job, "fixed-3-dlq", {"fail" => "always"})
        letters = Harness.eventually("#{name}'s dead letter", 60) { dlq_messages(job).then { |l| l.empty? ? nil : l } }
        assert_equal want["deadLetters"], letters.length
        assert_equal want["runs"], conf_runs(job).length
        assert_equal [w.pid], conf_runs(job).map { |r| r["pid"] }.uniq
        retries = job_events(w, "rebound.retry", job) + job_events(w, "rebound.dead_lettered", job)
        assert_equal [[1, "fallback", "cached"], [2, "fallback", "cached"], [3, "fallback", "cached"]],
          retries.map { |e| e.values_at("attempt", "source", "policy_source") }, name
        answers = expected_delays(probe.target, "fixed-3-dlq", job, "TransientError", [1, 2, 3])
        assert_equal answers.map { |x| x["delayMs"] }.first(2), retries.first(2).map { |e| e["delay_ms"] } # delaysEqualSidecar
        assert_equal "DECISION_GIVE_UP", answers[2]["decision"]
      end
    ensure
      [a, b].compact.each(&:stop)
      [sidecar, probe].compact.each(&:kill)
    end
  end

  def test_conformance_sidecar_down_at_start
    want = Conf.scenario("sidecar-down-at-start")["expect"]
    port = Harness.free_port
    target = "127.0.0.1:#{port}"
    with_broker("down-at-start") do |url|
      w = Conf.worker(target, "conformance/down-at-start", %w[fixed-3], redis_url: url).start # workerStarts
      warnings = Harness.eventually("the warning", 20) { w.events("rebound.sidecar_unavailable").then { |x| x.empty? ? nil : x } }
      assert_equal [target], warnings.map { |e| e["target"] } # logNamesTarget, once
      early = enqueue(:sidekiq_job, "fixed-3", {"fail" => 1})
      Harness.eventually("a default answer", 30) { job_events(w, "rebound.retry", early).first }.then do |e|
        assert_equal ["fallback", want.fetch("policySource", "default")], e.values_at("source", "policy_source")
      end
      sidecar = Conf.sidecar("conformance/sidecar-late", port: port).start
      t0 = Time.now
      first = nil
      jobs = []
      Harness.eventually("a sidecar answer", 30) do
        jobs << enqueue(:sidekiq_job, "fixed-3", {"fail" => 1})
        sleep 0.1
        first = w.events("rebound.retry").find { |e| e["source"] == "sidecar" }
      end
      back_ms = ((Time.iso8601(first["time"]) - t0) * 1000).round
      puts format("\nsidecar-down-at-start: first sidecar answer %d ms after the sidecar was serving", back_ms)
      assert_operator back_ms, :<=, want.fetch("assertBackToSidecarWithinMs", 5000) # generous; the figure is backToSidecarWithinMs
      assert_equal want.fetch("thenPolicySource", "sidecar"), first["policy_source"]
      fetched = Harness.eventually("the prefetch again", 20) { w.events("rebound.policy_fetched").find { |e| e["queue"] == "fixed-3" } }
      assert_operator Time.iso8601(fetched["time"]), :>=, t0 - 1
      Harness.eventually("every job done", 60) { jobs.all? { |j| done?(j) } && done?(early) }
    ensure
      w&.stop
      sidecar&.kill
    end
  end

  def test_conformance_malformed_target_refused
    want = Conf.scenario("malformed-target-refused")
    queue = "conf-malformed-#{SecureRandom.hex(3)}"
    job = enqueue(:sidekiq_job, queue, {"fail" => 0})
    w = Conf.worker(want["target"], "conformance/malformed", [queue]).start(wait: false)
    status = w.wait_exit(60)
    refute status.success?, "sidekiq started with REBOUND_TARGET=#{want["target"]}" # workerStarts: false
    (e,) = Harness.events(w.log, "rebound.bad_target")
    assert_equal [want["expect"]["errorNames"], want["target"]], e.values_at("variable", "target")
    assert_equal 0, conf_runs(job).length # jobsRunBeforeRefusal
    assert_equal 1, Sidekiq::Queue.new(queue).size
  ensure
    Sidekiq::Queue.new(queue).clear if queue
  end

  def test_conformance_adapter_error_never_hands_to_library
    want = Conf.scenario("adapter-error-never-hands-to-library")["expect"]
    with_broker("adapter-error") do |url|
      target = Conf.shared_sidecar.target
      w = Conf.worker(target, "conformance/adapter-error", %w[fixed-3 conf-nopolicy], redis_url: url,
        env: {"REBOUND_TEST_FAULT" => "ask"}).start
      Harness.eventually("the policy prefetched", 20) { w.events("rebound.policy_fetched").any? { |e| e["queue"] == "fixed-3" } }
      t0 = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      job = enqueue(:sidekiq_job, "fixed-3", {"fail" => 2})
      Harness.eventually("completion", 60) { done?(job) }
      # Sidekiq's own curve would wait 15 + rand(10) s, then 16 + rand(20) s: libraryDefaultRetries 0.
      assert_operator Process.clock_gettime(Process::CLOCK_MONOTONIC) - t0, :<, 25
      assert_equal 3, conf_runs(job).length
      retries = job_events(w, "rebound.retry", job)
      assert_equal [[1, want["decidedBy"], "cached"], [2, want["decidedBy"], "cached"]], retries.map { |e| e.values_at("attempt", "source", "policy_source") }
      assert_equal expected_delays(target, "fixed-3", job, "TransientError", [1, 2]).map { |a| a["delayMs"] }, retries.map { |e| e["delay_ms"] }
      assert(retries.none? { |e| e["via"] }) # all by the middleware, none by Sidekiq's retrier
      assert_equal 2, job_events(w, "rebound.adapter_error", job).length
      assert_equal 0, Harness.events(w.log, "rebound.middleware_error").length
    ensure
      w&.stop
    end
    # A sidecar error answer (NOT_FOUND: no policy for the queue) ends in the fallback too.
    with_broker("error-answer") do |url|
      w = Conf.worker(Conf.shared_sidecar.target, "conformance/error-answer", %w[conf-nopolicy], redis_url: url).start
      job = enqueue(:sidekiq_job, "conf-nopolicy", {"fail" => 1})
      Harness.eventually("completion", 60) { done?(job) }
      (e,) = job_events(w, "rebound.retry", job)
      assert_equal %w[fallback default], e.values_at("source", "policy_source")
      assert(w.events("rebound.fallback").any? { |f| f["cause"] == "not_found" })
    ensure
      w&.stop
    end
    # The hook itself (Sidekiq's retrier, where the middleware did not run) never raises
    # and never answers "Sidekiq's default" (nil) for an error: hookRaises false.
    broken = Object.new
    def broken.decide(*) = raise("injected")
    def broken.decide_locally(*) = raise("injected")
    saved = Rebound::Sidekiq.rebound
    Rebound::Sidekiq.rebound = broken
    seconds = Rebound::Sidekiq::Worker.retry_in(ConformJob, 0, RuntimeError.new("x"), {"jid" => "j", "queue" => "fixed-3"})
    assert_kind_of Integer, seconds
    assert_operator seconds, :>=, 1
  ensure
    Rebound::Sidekiq.rebound = saved if saved
  end

  def test_conformance_sidecar_restart_reconnects
    want = Conf.scenario("sidecar-restart-reconnects")["expect"]
    port = Harness.free_port
    with_broker("restart") do |url|
      sidecar = Conf.sidecar("conformance/sidecar-restart", port: port).start
      w = Conf.worker(sidecar.target, "conformance/restart", %w[fixed-3], redis_url: url, concurrency: 4).start
      jobs = []
      pusher = Thread.new do
        loop do
          jobs << enqueue(:sidekiq_job, "fixed-3", {"fail" => 2})
          sleep 0.15
        end
      end
      sleep 1.5
      sidecar.kill
      sleep 1.5
      sidecar = Conf.sidecar("conformance/sidecar-restart-2", port: port).start
      t0 = Time.now
      sleep 4
      pusher.kill
      pusher.join
      first = w.events("rebound.retry").select { |e| e["source"] == "sidecar" && Time.iso8601(e["time"]) >= t0 }.min_by { |e| e["time"] }
      refute_nil first, "no sidecar answer after the restart"
      back_ms = ((Time.iso8601(first["time"]) - t0) * 1000).round
      puts format("\nsidecar-restart-reconnects: first sidecar answer %d ms after the restarted sidecar was serving", back_ms)
      assert_operator back_ms, :<=, want.fetch("assertBackToSidecarWithinMs", 5000) # generous; the figure is backToSidecarWithinMs
      assert(w.events("rebound.retry").any? { |e| e["source"] == "fallback" }, "the outage was seen")
      Harness.eventually("every job done (jobsLost 0)", 90) { jobs.all? { |j| done?(j) } }
      assert(jobs.all? { |j| conf_runs(j).length == 3 })
    ensure
      pusher&.kill
      w&.stop
      sidecar&.kill
    end
  end

  def test_conformance_worker_sigkill
    want = Conf.scenario("worker-sigkill")["expect"]
    with_broker("sigkill") do |url|
      target = Conf.shared_sidecar.target
      env = {"REBOUND_TEST_RELIABLE_FETCH" => "1"}
      a = Conf.worker(target, "conformance/sigkill-a", %w[fixed-3-dlq], redis_url: url, env: env).start
      job = enqueue(:sidekiq_job, "fixed-3-dlq", {"fail" => 0, "sleep_first" => 120})
      Harness.eventually("the job running", 30) { conf_runs(job).length == 1 }
      a.kill # SIGKILL, the whole process group
      b = Conf.worker(target, "conformance/sigkill-b", %w[fixed-3-dlq], redis_url: url, env: env).start
      Harness.eventually("the job completed on another process", 90) { done?(job) }
      seen = conf_runs(job)
      assert want["jobRunsAgain"] && seen.length >= 2
      assert_operator seen.length, :<=, want["runsAtMost"]
      assert_equal [job.key], seen.map { |r| r["jobId"] }.uniq # sameJobId
      assert_equal b.pid, seen.last["pid"]
      # The lost run counted as a failed run, decided by the policy (attempt 1: retry).
      (lost,) = job_events(b, "rebound.retry", job)
      assert_equal [1, "Rebound::Sidekiq::WorkerLost", "sidecar"], lost.values_at("attempt", "error_class", "source")
      assert_equal 1, job_events(b, "rebound.job_recovered", job).length
    ensure
      [a, b].compact.each(&:stop)
    end
  end

  # A job that kills its process on every run (OOM, say): each lost run counts, so it ends in
  # the dead set with its dead letter after maxAttempts runs instead of looping forever.
  def test_reliable_fetch_a_job_killing_every_process_ends_dead_after_max_attempts
    with_broker("poison") do |url|
      target = Conf.shared_sidecar.target
      env = {"REBOUND_TEST_RELIABLE_FETCH" => "1"}
      job = enqueue(:sidekiq_job, "fixed-3-dlq", {"fail" => 0, "sleep" => 120})
      workers = []
      (1..3).each do |run|
        workers << Conf.worker(target, "conformance/poison-#{run}", %w[fixed-3-dlq], redis_url: url, env: env).start
        Harness.eventually("run #{run}", 60) { conf_runs(job).length == run }
        workers.last.kill
      end
      workers << Conf.worker(target, "conformance/poison-4", %w[fixed-3-dlq], redis_url: url, env: env).start
      msg = Harness.eventually("the dead letter", 60) { dlq_messages(job).first }
      assert_equal [3, "GIVE_UP_REASON_MAX_ATTEMPTS", "Rebound::Sidekiq::WorkerLost"], msg.values_at("attempts", "reason", "error_class")
      assert Harness.eventually("the dead set entry", 10) { dead_entry(job) }
      assert_equal 3, conf_runs(job).length
    ensure
      workers&.each(&:stop)
    end
  end

  # ReliableFetch and a rolling deploy: SIGTERM (-t 3 s) puts the running job back onto its
  # queue (not a failed run), and the next process runs it.
  def test_reliable_fetch_sigterm_puts_the_running_job_back
    with_broker("sigterm") do |url|
      target = Conf.shared_sidecar.target
      env = {"REBOUND_TEST_RELIABLE_FETCH" => "1"}
      a = Conf.worker(target, "conformance/sigterm-a", %w[fixed-3-dlq], redis_url: url, env: env).start
      job = enqueue(:sidekiq_job, "fixed-3-dlq", {"fail" => 0, "sleep_first" => 120})
      Harness.eventually("the job running", 30) { conf_runs(job).length == 1 }
      a.stop
      assert(Sidekiq::Queue.new("fixed-3-dlq").any? { |j| j.jid == job.jid }, "SIGTERM requeues the running job")
      assert_equal 0, Sidekiq.redis { |c| c.keys("#{Rebound::Sidekiq::ReliableFetch::PREFIX}*").sum { |k| c.llen(k) } }
      b = Conf.worker(target, "conformance/sigterm-b", %w[fixed-3-dlq], redis_url: url, env: env).start
      Harness.eventually("the requeued job completed", 60) { done?(job) }
      assert_equal 2, conf_runs(job).length
      assert_equal [], job_events(b, "rebound.retry", job) # not a failure
    ensure
      [a, b].compact.each(&:stop)
    end
  end

  def test_conformance_broker_restart
    with_broker("broker-restart", persist: true) do |url, dir|
      target = Conf.shared_sidecar.target
      w = Conf.worker(target, "conformance/broker-restart", %w[fixed-3-dlq], redis_url: url, concurrency: 4).start
      jobs = Array.new(4) { enqueue(:sidekiq_job, "fixed-3-dlq", {"fail" => 1, "sleep" => 1.5}) }
      Harness.eventually("the jobs running", 30) { jobs.all? { |j| conf_runs(j).length == 1 } }
      Harness.stop_redis_keeping_data(dir) # while they run: they fail with Redis down
      sleep 3
      Harness.start_redis(dir, persist: true)
      Harness.eventually("every job done (jobsLost 0)", 90) { jobs.all? { |j| done?(j) } }
      jobs.each { |j| assert_operator conf_runs(j).length, :<=, 3 } # runsAtMostMaxAttempts
      assert(jobs.all? { |j| conf_runs(j).length == 2 })
    ensure
      w&.stop
    end
  end
end
