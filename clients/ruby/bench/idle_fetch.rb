# frozen_string_literal: true

# Idle Redis load of a fetch: 3 idle `sidekiq` processes (10 threads, 3 queues each) on a
# Redis of their own (dev/redis.sh); Redis INFO commandstats before and after 10 s; prints
# commands per second per process, by command. Not a test: figures for the README.
#
#   ruby clients/ruby/bench/idle_fetch.rb [basic rebound gitlab gitlab-semi]
require "fileutils"
require "redis"

REPO = File.expand_path("../../..", __dir__)
PROCESSES = 3
THREADS = 10
QUEUES = %w[q1 q2 q3].freeze
WINDOW_S = 10

def commandstats(redis)
  redis.info("commandstats").to_h { |k, v| [k.delete_prefix("cmdstat_"), v.is_a?(Hash) ? v["calls"].to_i : v[/calls=(\d+)/, 1].to_i] }
end

def measure(fetch)
  dir = File.join(REPO, ".state", "bench-idle-fetch", fetch)
  FileUtils.mkdir_p(dir)
  url = `#{REPO}/dev/redis.sh up #{dir}`.strip.split("\n").last
  redis = Redis.new(url: url)
  env = {"REDIS_URL" => url, "BENCH_FETCH" => fetch, "RUBYLIB" => File.join(REPO, "clients", "ruby", "lib")}
  cmd = ["sidekiq", "-r", File.join(__dir__, "idle_app.rb"), "-c", THREADS.to_s] + QUEUES.flat_map { |q| ["-q", q] }
  pids = Array.new(PROCESSES) do
    Process.spawn(env, *cmd, out: File.join(dir, "sidekiq.log"), err: [:child, :out], chdir: dir, pgroup: true)
  end
  sleep 1 until redis.scard("processes") == PROCESSES
  sleep 5 # past start-up
  before = commandstats(redis)
  sleep WINDOW_S
  after = commandstats(redis)
  delta = after.to_h { |k, v| [k, v - before.fetch(k, 0)] }.reject { |k, v| v.zero? || k == "info" }
  per = ->(n) { n.to_f / WINDOW_S / PROCESSES }
  puts format("%-12s %6.1f commands/s per idle process (%d processes x %d threads x %d queues): %s", fetch,
    per.call(delta.values.sum), PROCESSES, THREADS, QUEUES.length,
    delta.sort_by { |_, v| -v }.map { |k, v| format("%s %.1f", k, per.call(v)) }.join(", "))
ensure
  (pids || []).each { |pid| Process.kill("TERM", -pid) rescue nil }
  (pids || []).each { |pid| Process.wait(pid) rescue nil }
  system("#{REPO}/dev/redis.sh", "down", dir, out: File::NULL) if dir
end

(ARGV.empty? ? %w[basic rebound] : ARGV).each { |f| measure(f) }
