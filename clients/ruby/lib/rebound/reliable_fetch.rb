# frozen_string_literal: true

require "digest/sha1"
require "securerandom"
require "socket"
require "rebound/hook"

module Rebound
  module Sidekiq
    # The failure of a run whose process stopped without finishing it (SIGKILL, OOM, node
    # loss, a pause past ALIVE_TTL_S), found by ReliableFetch: decided by the policy like
    # any other failed run.
    class WorkerLost < StandardError; end

    # A fetch strategy for open-source Sidekiq that loses no job when a process is killed
    # or paused (what Sidekiq Pro's super_fetch does): Rebound::Sidekiq.reliable_fetch!.
    #
    # - Fetch: a job moves atomically from its queue to a working list of this process
    #   (rebound:working:IDENTITY|queue:NAME): one script tries every queue in order
    #   (LMOVE); a thread that finds nothing blocks on one queue (BLMOVE, BLOCK_S), as
    #   Sidekiq's BRPOP does, until a job comes.
    # - Liveness: a heartbeat thread of its own sets rebound:alive:IDENTITY (ALIVE_TTL_S)
    #   every BEAT_S; it never waits for the sidecar.
    # - Recovery: a thread of its own, one process at a time (a lease), SCANs for working
    #   lists (so a list needs no registration that could fall out of step) whose owner is
    #   not alive. Each job is claimed by one script that checks the owner is still not
    #   alive, fences the owner (rebound:fenced:IDENTITY) and moves the job, counted as a
    #   failed run (retry_count + 1, error class WorkerLost, whatever the class), to the
    #   recoverer's working list; the policy decides it outside any lease; one script then
    #   removes it and writes the retry, the dead set and dead letter, or the queue. A
    #   recoverer killed between the two leaves a claimed job that the next one settles
    #   without counting it again.
    # - A fenced process (it was paused, not dead) takes a new identity: it never fetches
    #   into a recovered list again. A run of it that ends later finds its job gone: a
    #   failure writes nothing (its run was counted), a success withdraws what the
    #   recoverer wrote while it is still there.
    # - A Rebound job's failure is written together with its acknowledgment (one script),
    #   so a kill or a lost reply in between neither doubles a dead letter nor counts a run
    #   twice; a write Redis refuses (OOM, ACL) is retried, the job held meanwhile.
    # - SIGTERM: the unfinished jobs go back onto their queues, as Sidekiq does.
    class ReliableFetch
      PREFIX = "rebound:working:"
      ALIVE = "rebound:alive:"
      FENCED = "rebound:fenced:"
      RECOVERED = "rebound:recovered:" # jid -> what a recovery wrote, withdrawn by a late success
      SETTLED = "rebound:settled:" # digest of a settled job string: a settle sent again is known
      LEASE = "rebound:recovery-lease"
      BEAT_S = 2
      ALIVE_TTL_S = 10
      RECOVER_S = 3
      BLOCK_S = 2
      FENCE_TTL_S = 7 * 24 * 3600
      DEAD_TIMEOUT_S = 180 * 24 * 60 * 60 # Sidekiq's dead set: 6 months, 10,000 jobs
      DEAD_MAX = 10_000

      # Redis >= 7 (#!lua): a script that may write is refused whole under maxmemory, never
      # stopped half-way.
      SCRIPTS = {
        # KEYS: fenced, then queue/working pairs. -> {-1} fenced, {0} nothing, {i, job}.
        fetch: <<~LUA,
          #!lua
          if redis.call('EXISTS', KEYS[1]) == 1 then return {-1} end
          for i = 2, #KEYS, 2 do
            local job = redis.call('LMOVE', KEYS[i], KEYS[i + 1], 'RIGHT', 'LEFT')
            if job then return {i, job} end
          end
          return {0}
        LUA
        # After BLMOVE: a fenced identity puts the job back where it was. KEYS: fenced, working, queue.
        check: <<~LUA,
          #!lua
          if redis.call('EXISTS', KEYS[1]) == 0 then return 1 end
          if redis.call('LREM', KEYS[2], -1, ARGV[1]) == 1 then redis.call('RPUSH', KEYS[3], ARGV[1]) end
          return 0
        LUA
        # KEYS: alive, fenced, working, claimed. ARGV: job, counted job, fence ttl.
        claim: <<~LUA,
          #!lua
          if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
          redis.call('SET', KEYS[2], '1', 'EX', ARGV[3])
          if redis.call('LREM', KEYS[3], -1, ARGV[1]) == 0 then return 0 end
          redis.call('LPUSH', KEYS[4], ARGV[2])
          return 1
        LUA
        # Writes the outcome and removes ARGV[1] from KEYS[1] (a working list), only if it
        # is there; a write refused half-way (ACL) leaves the job there to try again.
        # KEYS: working, retry, dead, queues, target queue, recovered, settled.
        # ARGV: job, kind (retry|dead|queue), payload, retry at, now, dead letter,
        # recovered record ('' = none), ttl. -> 1 written, 2 written before (a lost
        # reply, sent again), 0 gone (recovered meanwhile).
        settle: <<~LUA,
          #!lua
          if not redis.call('LPOS', KEYS[1], ARGV[1]) then
            if redis.call('EXISTS', KEYS[7]) == 1 then return 2 end
            return 0
          end
          local kind = ARGV[2]
          if kind == 'retry' then
            redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
          elseif kind == 'dead' then
            if ARGV[6] ~= '' then
              redis.call('LPUSH', KEYS[5], ARGV[6])
              redis.call('SADD', KEYS[4], string.sub(KEYS[5], 7))
            end
            if ARGV[3] ~= '' then
              local now = tonumber(ARGV[5])
              redis.call('ZADD', KEYS[3], ARGV[5], ARGV[3])
              redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - #{DEAD_TIMEOUT_S})
              redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -#{DEAD_MAX + 1})
            end
          elseif kind == 'queue' then
            redis.call('RPUSH', KEYS[5], ARGV[3])
            redis.call('SADD', KEYS[4], string.sub(KEYS[5], 7))
          end
          if ARGV[7] ~= '' then redis.call('SET', KEYS[6], ARGV[7], 'EX', ARGV[8]) end
          redis.call('SET', KEYS[7], '1', 'EX', 60)
          redis.call('LREM', KEYS[1], -1, ARGV[1])
          return 1
        LUA
        # A run that succeeded after its job was recovered: removes what the recovery
        # wrote, where it still is. KEYS: recovered, retry, dead, target queue, dead-letter queue.
        withdraw: <<~LUA
          #!lua
          local raw = redis.call('GET', KEYS[1])
          if not raw then return 0 end
          local r = cjson.decode(raw)
          local n = 0
          if r.kind == 'retry' then n = redis.call('ZREM', KEYS[2], r.payload)
          elseif r.kind == 'queue' then n = redis.call('LREM', KEYS[4], -1, r.payload)
          elseif r.kind == 'dead' then
            n = redis.call('ZREM', KEYS[3], r.payload)
            if r.letter then n = n + redis.call('LREM', KEYS[5], -1, r.letter) end
          end
          redis.call('DEL', KEYS[1])
          return n
        LUA
      }.freeze
      SHAS = SCRIPTS.transform_values { |s| Digest::SHA1.hexdigest(s) }.freeze

      def self.script(conn, name, keys, argv = [])
        conn.evalsha(SHAS.fetch(name), keys: keys, argv: argv)
      rescue StandardError => e
        raise unless e.message.to_s.start_with?("NOSCRIPT")
        conn.eval(SCRIPTS.fetch(name), keys: keys, argv: argv)
      end

      # A job fetched into a working list. settled: its failure was written with its removal.
      class UnitOfWork
        attr_reader :queue, :job, :working
        attr_accessor :settled

        def initialize(queue, job, working)
          @queue = queue
          @job = job
          @working = working
        end

        def queue_name = queue.delete_prefix("queue:")

        def jid
          @jid ||= (::Sidekiq.load_json(job)["jid"] rescue nil)
        end

        # Gone from the working list means recovered while it ran (a pause past the alive
        # TTL): the run succeeded after all, so what the recovery wrote is withdrawn.
        def acknowledge
          return if settled
          ::Sidekiq.redis do |c|
            next unless c.lrem(working, -1, job).zero? && jid
            rec = (JSON.parse(c.get("#{RECOVERED}#{jid}").to_s) rescue {})
            n = ReliableFetch.script(c, :withdraw, ["#{RECOVERED}#{jid}", "retry", "dead", queue, "queue:#{rec["dlq"]}"])
            Rebound.log("warn", "rebound.recovered_run_completed", jid: jid, queue: queue_name, withdrawn: n)
          end
        end

        # Writes the failure's outcome with the job's removal (see ReliableFetch.settle).
        def settle(kind, payload, **outcome)
          ReliableFetch.settle(self, kind, payload, **outcome)
        end

        def requeue
          ::Sidekiq.redis do |c|
            c.multi do |t|
              t.rpush(queue, job)
              t.lrem(working, -1, job)
            end
          end
        end
      end

      attr_reader :identity

      # options: Sidekiq 6's options hash, or a Sidekiq 7 capsule/config (queues, strict).
      def initialize(options)
        queues = options.respond_to?(:queues) ? options.queues : options[:queues]
        raise ArgumentError, "missing queue list" unless queues
        @strict = !!(options.respond_to?(:strict) ? options.strict : options[:strict])
        @queues = queues.map { |q| "queue:#{q}" }
        @queues.uniq! if @strict
        @identities = []
        @identity = new_identity
        @lock = Mutex.new
        @threads = nil
      end

      def working_key(queue, identity = @identity) = "#{PREFIX}#{identity}|#{queue}"

      # A thread that found nothing last time blocks straight away, on its queues in turn:
      # idle, it costs one BLMOVE per BLOCK_S, as BRPOP does.
      def retrieve_work
        start!
        id = @identity
        order = queues_cmd
        unless Thread.current[:rebound_fetch_idle]
          res = ::Sidekiq.redis { |c| ReliableFetch.script(c, :fetch, ["#{FENCED}#{id}"] + order.flat_map { |q| [q, working_key(q, id)] }) }
          if res.first == -1
            refenced(id)
            return nil
          end
          return unit(order[(res[0] - 2) / 2], res[1], id) if res.first.positive?
        end
        turn = Thread.current[:rebound_fetch_turn] = Thread.current[:rebound_fetch_turn].to_i + 1
        q = Thread.current[:rebound_fetch_idle] ? @queues.uniq[turn % @queues.uniq.length] : order.first
        w = working_key(q, id)
        job = ::Sidekiq.redis { |c| c.blmove(q, w, "RIGHT", "LEFT", timeout: BLOCK_S) }
        Thread.current[:rebound_fetch_idle] = job.nil?
        return nil unless job
        ok = ::Sidekiq.redis { |c| ReliableFetch.script(c, :check, ["#{FENCED}#{id}", w, q], [job]) }
        return unit(q, job, id) if ok == 1
        refenced(id)
        nil
      end

      # At shutdown: every unfinished job of this process back onto its queue.
      def bulk_requeue(_inprogress, _options = nil)
        n = 0
        ::Sidekiq.redis do |c|
          @identities.each do |id|
            @queues.uniq.each do |q|
              w = working_key(q, id)
              n += 1 while c.lmove(w, q, "RIGHT", "RIGHT")
            end
          end
          c.del("#{ALIVE}#{@identity}") if @stopping
        end
        Rebound.log("info", "rebound.fetch_requeued", jobs: n) if n > 0
      rescue StandardError => e
        Rebound.log("warn", "rebound.fetch_requeue_failed", error: e.message.to_s[0, 300])
      end

      def queues_cmd
        return @queues if @strict
        @queues.shuffle.uniq
      end

      # One heartbeat: false when this identity was fenced (its lists were recovered while
      # it did not beat), and then a new one is taken.
      def beat
        id = @identity
        fenced = ::Sidekiq.redis do |c|
          f = c.exists?("#{FENCED}#{id}")
          c.set("#{ALIVE}#{id}", "1", ex: ALIVE_TTL_S) unless f
          f
        end
        return true unless fenced
        refenced(id)
        false
      end

      # Recovers the jobs of processes no longer alive; returns how many.
      def recover
        found = 0
        keys = []
        ::Sidekiq.redis { |c| c.scan_each(match: "#{PREFIX}*", count: 1000) { |k| keys << k } }
        keys.uniq.each do |key|
          owner, queue = key.delete_prefix(PREFIX).split("|", 2)
          next if owner.nil? || queue.nil? || @identities.include?(owner)
          next if ::Sidekiq.redis { |c| c.exists?("#{ALIVE}#{owner}") }
          while (job = ::Sidekiq.redis { |c| c.lindex(key, -1) })
            r = recover_one(key, owner, queue, job)
            break if r == :alive || r == :error # an error: the next round tries again
            found += 1 if r == :settled
          end
        end
        found
      end

      private

      def new_identity
        id = "#{Socket.gethostname}:#{Process.pid}:#{SecureRandom.hex(6)}"
        @identities << id
        id
      end

      def refenced(id)
        @lock.synchronize do
          return unless @identity == id
          @identity = new_identity
          Rebound.log("warn", "rebound.fetch_fenced", identity: id, new_identity: @identity)
          ::Sidekiq.redis { |c| c.set("#{ALIVE}#{@identity}", "1", ex: ALIVE_TTL_S) }
        end
      end

      def unit(queue, job, id)
        u = UnitOfWork.new(queue, job, working_key(queue, id))
        Thread.current[:rebound_unit] = u
        u
      end

      # The first heartbeat before the first fetch; then heartbeat and recovery threads.
      def start!
        return if @threads&.all?(&:alive?)
        @lock.synchronize do
          return if @threads&.all?(&:alive?)
          ::Sidekiq.redis do |c|
            c.set("#{ALIVE}#{@identity}", "1", ex: ALIVE_TTL_S)
            SCRIPTS.each_value { |src| c.script(:load, src) }
          end
          @threads = [Thread.new { every(BEAT_S, "heartbeat") { beat } },
                      Thread.new { every(RECOVER_S, "recover") { recover if lease } }]
        end
      end

      def every(seconds, what)
        loop do
          begin
            yield
          rescue StandardError => e
            Rebound.log("warn", "rebound.fetch_#{what}_error", error: e.message.to_s[0, 300])
          end
          sleep seconds
        end
      end

      # One process recovers at a time; the lease lapses by itself, and claims stay atomic
      # if two ever overlap.
      def lease
        ::Sidekiq.redis { |c| c.set(LEASE, @identity, nx: true, px: (RECOVER_S * 1000) - 100) }
      end

      # Claims one job of a lost list (counted), decides it, settles it. A job claimed by a
      # recoverer that died before settling names it (rebound_claimed_by) and is found in
      # its list: it is not counted again.
      def recover_one(key, owner, queue, job)
        msg = ::Sidekiq.load_json(job)
        mine = working_key(queue, @identity)
        counted = if msg["rebound_claimed_by"] == owner
          job
        else
          c = Failure.count(msg, queue.delete_prefix("queue:"), WorkerLost.new("the process #{owner} stopped while the job ran"))
          c["rebound_claimed_by"] = @identity
          ::Sidekiq.dump_json(c)
        end
        r = ::Sidekiq.redis { |c| ReliableFetch.script(c, :claim, ["#{ALIVE}#{owner}", "#{FENCED}#{owner}", key, mine], [job, counted, FENCE_TTL_S]) }
        return :alive if r == -1
        return :taken if r.zero?
        settle_recovered(UnitOfWork.new(queue, counted, mine), owner)
        :settled
      rescue StandardError => e
        Rebound.hook_error("rebound.recover_failed", error: e.inspect[0, 300])
        :error
      end

      def settle_recovered(unit, owner)
        msg = ::Sidekiq.load_json(unit.job)
        msg.delete("rebound_claimed_by")
        klass = (Object.const_get(msg["class"].to_s) rescue nil)
        rebound = (klass && klass.include?(Rebound::Sidekiq::Worker)) || !Rebound::Sidekiq.active_job_class(msg).nil? || msg["rebound"]
        Rebound.log("warn", "rebound.job_recovered", jid: msg["jid"], queue: unit.queue_name, from: owner, decided: !!rebound,
          job_class_loaded: !klass.nil?, attempt: msg["retry_count"].to_i + 1)
        if rebound && msg["retry"]
          worker = (klass.new rescue nil) if klass
          exc = WorkerLost.new("the process #{owner} stopped while the job ran")
          Failure.carry_out(worker, msg, unit.queue_name, exc, unit, recovered: true)
        else # counted all the same: the next run's attempt is one higher
          ReliableFetch.settle(unit, "queue", ::Sidekiq.dump_json(msg), recovered: {"kind" => "queue", "payload" => ::Sidekiq.dump_json(msg)})
        end
      end

      public

      # Writes a failure's outcome together with the job's removal from its working list;
      # false when the job was no longer there (recovered meanwhile). Refused or failed
      # writes are tried again (the job stays held meanwhile).
      def self.settle(unit, kind, payload, at: 0, dead_letter_queue: nil, letter: nil, recovered: nil)
        keys = [unit.working, "retry", "dead", "queues", dead_letter_queue ? "queue:#{dead_letter_queue}" : unit.queue,
                "#{RECOVERED}#{unit.jid}", "#{SETTLED}#{Digest::SHA1.hexdigest(unit.job)}"]
        rec = recovered ? ::Sidekiq.dump_json(recovered) : ""
        argv = [unit.job, kind, payload, at.to_s, Time.now.to_f.to_s, letter || "", rec, 3600]
        logged = false
        begin
          r = ::Sidekiq.redis do |c|
            script(c, :settle, keys, argv)
          end
          unit.settled = true
          Rebound.log("info", "rebound.settle_repeated", jid: unit.jid, kind: kind) if r == 2
          r != 0
        rescue StandardError => e
          raise unless Rebound::Sidekiq.redis_connection_error?(e) || e.message.to_s.match?(/\A(OOM|NOPERM|READONLY|BUSY|LOADING|MASTERDOWN|TRYAGAIN)/)
          Rebound.log("warn", "rebound.settle_refused", jid: unit.jid, kind: kind, error: e.message.to_s[0, 300]) unless logged
          logged = true
          sleep 0.5
          retry
        end
      end

      # ReliableFetch in this server process (what Rebound::Sidekiq.reliable_fetch! calls).
      def self.install
        ::Sidekiq.configure_server do |config|
          if ::Sidekiq.respond_to?(:options) && ::Sidekiq.options.is_a?(Hash) # 6.x: an instance
            fetch = ReliableFetch.new(::Sidekiq.options)
            ::Sidekiq.options[:fetch] = fetch
            config.on(:shutdown) { fetch.instance_variable_set(:@stopping, true) }
          else # 7.x: a class, made per capsule
            config[:fetch_class] = ReliableFetch
          end
        end
      end
    end
  end
end
