# frozen_string_literal: true

# Started by the test harness (test_helper.rb) in its own process group: waits for the test
# process PARENT_PID to end and then stops whatever its registry file still lists (process
# groups, dev/redis.sh state dirs). A test process that ends normally has emptied the list
# already; one killed with SIGKILL has not, and nothing is left behind either way.
#
#   ruby test/watchdog.rb PARENT_PID REGISTRY_FILE REPO
parent, registry, repo = ARGV[0].to_i, ARGV[1], ARGV[2]

def alive?(pid)
  Process.kill(0, pid)
  true
rescue Errno::ESRCH
  false
rescue Errno::EPERM
  true
end

sleep 0.5 while alive?(parent)
entries = File.exist?(registry) ? File.readlines(registry, chomp: true) : []
groups = entries.filter_map { |l| l[/\Apgroup (\d+)\z/, 1]&.to_i }
redises = entries.filter_map { |l| l[/\Aredis (.+)\z/, 1] }
$stderr.puts "watchdog: test process #{parent} gone; stopping #{groups.length} process groups, #{redises.length} redis" unless entries.empty?
groups.each { |g| Process.kill("TERM", -g) rescue nil }
sleep 1 unless groups.empty?
groups.each { |g| Process.kill("KILL", -g) rescue nil }
redises.each { |d| system(File.join(repo, "dev", "redis.sh"), "down", d, out: File::NULL, err: File::NULL) }
