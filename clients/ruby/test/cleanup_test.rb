# frozen_string_literal: true

# Every process a test starts is stopped, on failure too: a suite that fails with a
# sidecar, a sidekiq process and Redis running leaves none of them; one SIGKILLed (no
# at_exit, no after_run) leaves none either (test/watchdog.rb). `rake test` checks the same
# for the whole suite afterwards (the leftovers task).
require_relative "test_helper"

class CleanupTest < Minitest::Test
  SUITE = File.join(HERE, "support", "leaky_suite.rb")

  # PIDs of the processes working in run_dir (every child runs there; redis-server in its
  # data dir there), or carrying REBOUND_TEST_RUN=run_dir.
  def started_by(run_dir)
    Dir.glob("/proc/[0-9]*").filter_map do |d|
      cwd = File.readlink("#{d}/cwd") rescue next
      env = (File.binread("#{d}/environ").split("\0").include?("REBOUND_TEST_RUN=#{run_dir}") rescue false)
      File.basename(d).to_i if cwd == run_dir || cwd.start_with?("#{run_dir}/") || env
    end
  end

  def run_leaky(hang:)
    ready = File.join(Harness.run_dir, "leaky-#{hang ? "killed" : "failed"}.ready")
    log = File.join(Harness.run_dir, "leaky-#{hang ? "killed" : "failed"}.log")
    env = {"LEAKY_READY" => ready, "LEAKY_HANG" => hang ? "1" : "0", "REBOUND_BIN_DIR" => Harness.bin_dir}
    pid = Process.spawn(env, "ruby", "-I#{LIB}", "-I#{HERE}", SUITE, chdir: File.join(REPO, "clients", "ruby"),
      in: File::NULL, out: [log, "a"], err: [log, "a"])
    Harness::LOCK.synchronize { Harness::CHILDREN[pid] = true }
    dir = Harness.eventually("the leaky suite's processes up", 120) { File.exist?(ready) && File.read(ready) }
    running = started_by(dir)
    assert_operator running.length, :>=, 3, "a sidecar, a sidekiq process and redis-server"
    if hang
      Process.kill("KILL", pid)
      Process.wait(pid)
    else
      File.write("#{ready}.go", "")
      _, st = Process.wait2(pid)
      refute st.success?, "the leaky suite fails"
    end
    Harness::LOCK.synchronize { Harness::CHILDREN.delete(pid) }
    Harness.eventually("nothing left of #{dir}", 30) { started_by(dir).empty? }
  ensure
    Process.kill("KILL", pid) rescue nil if pid
  end

  def test_a_failing_suite_stops_everything_it_started
    run_leaky(hang: false)
  end

  def test_a_sigkilled_suite_leaves_nothing_either
    run_leaky(hang: true)
  end
end
