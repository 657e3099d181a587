package faultproxy

import "net"

// SetRefusing makes the proxy refuse new connections while on, as a target
// that is down or out of connection slots would: each one is accepted and
// reset at once, before the target is dialled. Connections already open are
// not touched; [Proxy.CutAll] cuts those. Works for any protocol, so a
// database client's connections can be routed through the proxy too.
func (p *Proxy) SetRefusing(on bool) { p.refusing.Store(on) }

// CutAll closes every open connection, both the client's and the target's
// side, as a network failure or a restarted target would, and returns how
// many client connections it cut. New connections are accepted as usual
// unless the proxy is refusing.
func (p *Proxy) CutAll() int {
	p.mu.Lock()
	var links []*link
	for c := range p.closers {
		if l, ok := c.(*link); ok {
			links = append(links, l)
		}
	}
	p.mu.Unlock()
	for _, l := range links {
		_ = l.Close()
	}
	p.connectionsCut.Add(int64(len(links)))
	return len(links)
}

// refuse resets c: with SO_LINGER 0, Close sends RST instead of FIN, so the
// client sees "connection reset" rather than a clean end of stream.
func (p *Proxy) refuse(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
	p.connectionsRefused.Add(1)
}
